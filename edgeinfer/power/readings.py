"""`Readings`: what the sensors of one device said at one moment. Every field is None (or empty)
where the device has no such sensor or it could not be read; readers never raise.

Units are in the names: degrees Celsius, MHz, watts, percent. A reading the readers judged absurd
(a temperature of 400 °C, a negative battery) is dropped to None with a line in `warnings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PiThrottle:
    """Raspberry Pi firmware throttle flags (`vcgencmd get_throttled`, a bit mask): now and since boot."""
    raw: int
    under_voltage: bool  # bit 0
    freq_capped: bool  # bit 1: ARM frequency capped
    throttled: bool  # bit 2
    soft_temp_limit: bool  # bit 3: soft temperature limit active
    under_voltage_since_boot: bool  # bit 16
    freq_capped_since_boot: bool  # bit 17
    throttled_since_boot: bool  # bit 18
    soft_temp_limit_since_boot: bool  # bit 19

    @classmethod
    def from_mask(cls, mask: int) -> "PiThrottle":
        bit = lambda n: bool(mask >> n & 1)  # noqa: E731
        return cls(mask, bit(0), bit(1), bit(2), bit(3), bit(16), bit(17), bit(18), bit(19))

    @property
    def limited_now(self) -> bool:
        """The firmware is slowing the CPU now (capped, throttled or at the soft temperature limit)."""
        return self.freq_capped or self.throttled or self.soft_temp_limit


# Android's thermal status levels (PowerManager.THERMAL_STATUS_*), in order
ANDROID_THERMAL_STATUS = ("none", "light", "moderate", "severe", "critical", "emergency", "shutdown")


@dataclass(frozen=True)
class Readings:
    time_s: float = 0.0  # time.monotonic() when read (or the simulation's clock)
    device: str | None = None  # what the device says it is, e.g. "Raspberry Pi 5 Model B Rev 1.0"
    temp_c: float | None = None  # the hottest CPU/SoC temperature
    throttle_temp_c: float | None = None  # where the device starts throttling itself (a passive trip point)
    critical_temp_c: float | None = None  # where it shuts down (a critical trip point)
    zones: tuple[tuple[str, float], ...] = ()  # (sensor name, °C) for every temperature read
    cpu_freq_mhz: float | None = None  # current frequency, mean over the CPUs that report one
    cpu_max_freq_mhz: float | None = None  # the highest scaling_max_freq / cpuinfo_max_freq
    battery_pct: float | None = None  # 0..100
    charging: bool | None = None
    on_ac: bool | None = None  # external power present (AC adapter, USB)
    power_w: float | None = None  # the whole device's draw: battery discharge, or a Jetson's VDD_IN rail
    rails: tuple[tuple[str, float], ...] = ()  # (rail name, W), e.g. Jetson INA3221 VDD_CPU_GPU_CV
    pi_throttle: PiThrottle | None = None
    power_mode: str | None = None  # Jetson nvpmodel mode name, e.g. "15W"
    gpu_load_pct: float | None = None
    gpu_freq_mhz: float | None = None
    thermal_status: str | None = None  # Android ANDROID_THERMAL_STATUS name, or "nominal"/"warning" (macOS)
    cpu_speed_limit_pct: float | None = None  # macOS pmset -g therm: CPU_Speed_Limit
    cpu_count: int | None = None  # CPUs this process may run on
    sources: tuple[str, ...] = ()  # what was read, e.g. ("thermal_zone", "power_supply", "vcgencmd")
    warnings: tuple[str, ...] = field(default=())  # readings dropped as garbage or absurd, sensors gone

    @property
    def on_battery(self) -> bool:
        """Running from a battery now: no external power is (unknown: False). A battery whose level cannot
        be read still counts (a hostile round: capacity 255 or "Unknown" while discharging kept every
        core under the battery policy)."""
        return self.on_ac is False

    def as_dict(self) -> dict:
        """A JSON-ready dict (for `edgeinfer power --json`, /health and the simulation's log)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["zones"] = [list(z) for z in self.zones]  # pairs: two sensors may share a name (acpitz)
        d["rails"] = dict(self.rails)
        d["pi_throttle"] = None if self.pi_throttle is None else {
            k: getattr(self.pi_throttle, k) for k in self.pi_throttle.__dataclass_fields__}
        d["sources"], d["warnings"] = list(self.sources), list(self.warnings)
        d["on_battery"] = self.on_battery
        return d
