#!/usr/bin/env bash
# check_arm64.sh: build edgeinfer and run its test suite on 64-bit ARM Linux (aarch64, the OS family
# of the Raspberry Pi and the Jetson) from an x86-64 Debian machine, in an arm64 Debian root under
# qemu user emulation. Never imported by the package, not run by CI.
#
# Needs: root, a Debian-based host with apt (Debian 12 seen here), the Debian mirror and PyPI, a
#        kernel with binfmt_misc (the script mounts it if needed), ~3 GiB of disk under $ARM64_ROOT.
# Does, each step skipped when already done (re-running is safe and only redoes the copy, the
#        build and the tests):
#   1. apt-get install qemu-user-static binfmt-support debootstrap, if missing;
#   2. binfmt: mounts /proc/sys/fs/binfmt_misc if it is not, enables the qemu-aarch64 entry
#      (update-binfmts; failing that, writes the entry to binfmt_misc/register itself), so that
#      every aarch64 program in the root (python, gcc, pip's subprocesses) runs through
#      qemu-aarch64-static; the interpreter the entry names is copied into the root, so a chroot
#      finds it whether or not the entry has the F (fix-binary) flag;
#   3. debootstrap --arch=arm64 --foreign --variant=minbase $SUITE into $ARM64_ROOT, then
#      `chroot $ARM64_ROOT /debootstrap/debootstrap --second-stage` (arm64 binaries, emulated);
#      mounts /proc, /sys, /dev, /dev/pts and /dev/shm in the root for the run (unmounted at exit),
#      and, where the emulator passes the host's x86 /proc/cpuinfo through (qemu 7.2, Debian 12),
#      bind-mounts an arm64 one for $QEMU_CPU over it: onnxruntime crashes on import otherwise;
#      every program in the root runs as a $QEMU_CPU core (QEMU_CPU in its environment);
#   4. apt-get install python3 python3-venv python3-dev gcc libc6-dev inside the root;
#   5. copies the working tree (tracked files and untracked files git does not ignore, so no
#      venvs, build/ or host .so files) to /src/edgeinfer in the root, afresh on every run;
#   6. a venv at /opt/venv in the root; `pip install -v -e ".[test]"` (aarch64 wheels of numpy,
#      onnxruntime, tokenizers ... from PyPI; the sampler's C extension compiled by the root's gcc);
#   7. checks that the C extension built: edgeinfer.sampling.BACKEND must be "c" (the extension is
#      optional=True in setup.py, so a failed compile would otherwise pass silently);
#   8. runs the README's test command, `python -m pytest` (arguments given to this script, but -h and --help, are
#      passed on to pytest, e.g. `scripts/check_arm64.sh tests/test_sampling.py`).
# Takes (2 x86-64 cores, measured 2026-11-30): first run 5-7 min before the tests (debootstrap
#        ~1.5 min, apt-get in the root ~2.5 min, venv and pip ~2.5 min), a re-run ~1 min before the
#        tests; the whole suite then ~20 min (qemu-user translates every instruction: ~13x slower
#        than natively).
# Prints: progress lines "== step ...", and at the end a summary (also in $LOG_DIR/summary.txt):
#        date, Debian and Python versions in the root, uname -m there, the BACKEND, pytest's result
#        line and its short summary of failures and errors. Full logs: $LOG_DIR/*.log.
# Exit status: pytest's (0: all passed), or 2 when the C extension did not build, 1 on set-up errors.
#
# Settings (environment): ARM64_ROOT (/var/tmp/edgeinfer-arm64), SUITE (bookworm),
# QEMU_CPU (cortex-a76), MIRROR (the .../debian mirror in the host's apt sources),
# LOG_DIR (/var/tmp/edgeinfer-arm64-logs),
# FRESH=1 (delete the root and start over).
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # (pytest's arguments follow; --help went to the
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'  # root job itself: a scripts round)
    exit 0
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
ARM64_ROOT=${ARM64_ROOT:-/var/tmp/edgeinfer-arm64}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-}
if [ -z "$MIRROR" ]; then  # the Debian mirror the host's apt already uses
    MIRROR=$(sed -n 's|^URIs:[[:space:]]*\([^[:space:]]*/debian\)/\{0,1\}[[:space:]]*$|\1|p' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
fi
if [ -z "$MIRROR" ]; then
    MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '$1 == "deb" {
        for (i = 2; i <= NF; i++) if ($i ~ /^(https?|ftp):\/\/.*\/debian\/?$/) { sub(/\/$/, "", $i); print $i; exit } }')
fi
LOG_DIR=${LOG_DIR:-/var/tmp/edgeinfer-arm64-logs}
QEMU=/usr/bin/qemu-aarch64-static
# The emulated core: the Raspberry Pi 5's Cortex-A76 (the Jetson Orin's A78AE is its sibling; a Pi 4's
# A72 is `QEMU_CPU=cortex-a72`). qemu's default, "max", has SVE, which neither board has.
QEMU_CPU=${QEMU_CPU:-cortex-a76}
case $QEMU_CPU in  # MIDR fields and /proc/cpuinfo features of the real core, for the cpuinfo stand-in
    cortex-a72) CPU_VARIANT=0x0 CPU_PART=0xd08 CPU_FEATURES="fp asimd evtstrm crc32 cpuid" ;;
    neoverse-n1) CPU_VARIANT=0x3 CPU_PART=0xd0c CPU_FEATURES="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs" ;;
    *) CPU_VARIANT=0x4 CPU_PART=0xd0b CPU_FEATURES="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" ;;
esac
mkdir -p "$LOG_DIR"

step() { printf '== %s  %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { printf 'check_arm64: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot, binfmt_misc)"
[ -n "$MIRROR" ] || die "no Debian mirror in the host's apt sources: set MIRROR"
[ "$(uname -m)" = aarch64 ] && die "this machine is already aarch64: run the tests natively"

# -- 1. host packages ----------------------------------------------------------------------------
missing=()
for p in qemu-user-static binfmt-support debootstrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    step "apt-get install ${missing[*]}"
    apt-get update -q >"$LOG_DIR/host-apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$LOG_DIR/host-apt.log" 2>&1
fi
[ -x "$QEMU" ] || die "$QEMU missing after installing qemu-user-static"

# -- 2. binfmt_misc --------------------------------------------------------------------------------
BM=/proc/sys/fs/binfmt_misc
if [ ! -e "$BM/register" ]; then
    step "mount binfmt_misc"
    mount -t binfmt_misc binfmt_misc "$BM" || die "cannot mount binfmt_misc: aarch64 programs cannot be run transparently here"
fi
if ! grep -qx enabled "$BM/qemu-aarch64" 2>/dev/null; then
    step "enable the qemu-aarch64 binfmt entry"
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
fi
if ! grep -qx enabled "$BM/qemu-aarch64" 2>/dev/null; then
    # update-binfmts could not do it (no binfmt-support data, say): register by hand, F so the
    # kernel opens the interpreter now and the chroot need not contain it.
    printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:FP' \
        >"$BM/register" 2>/dev/null || die "cannot register qemu-aarch64 in binfmt_misc"
fi
INTERP=$(sed -n 's/^interpreter //p' "$BM/qemu-aarch64")
FLAGS=$(sed -n 's/^flags: //p' "$BM/qemu-aarch64")
BINFMT_NOTE="binfmt_misc entry qemu-aarch64, interpreter $INTERP, flags $FLAGS"

# -- 3. the arm64 Debian root ----------------------------------------------------------------------
install_interp() {  # the interpreter at the path the binfmt entry names, inside the root
    install -D -m 755 "$QEMU" "$ARM64_ROOT/usr/bin/qemu-aarch64-static"
    if [ "$INTERP" != /usr/bin/qemu-aarch64-static ]; then
        mkdir -p "$ARM64_ROOT$(dirname "$INTERP")"
        ln -sf /usr/bin/qemu-aarch64-static "$ARM64_ROOT$INTERP"
    fi
}
MOUNTED=()
umount_all() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTED[i]}" 2>/dev/null || true; done
    MOUNTED=()
}
trap umount_all EXIT
mount_fs() {  # /proc, /sys, /dev, /dev/pts, /dev/shm for the chroot (psutil, sensors, multiprocessing)
    local t
    for t in proc sys dev dev/pts dev/shm; do
        mkdir -p "$ARM64_ROOT/$t"
        mountpoint -q "$ARM64_ROOT/$t" && continue
        case $t in
            proc) mount -t proc proc "$ARM64_ROOT/proc" ;;
            sys) mount -t sysfs sysfs "$ARM64_ROOT/sys" ;;
            dev) mount --bind /dev "$ARM64_ROOT/dev" ;;
            dev/pts) mount -t devpts devpts "$ARM64_ROOT/dev/pts" ;;
            dev/shm) mount -t tmpfs -o mode=1777 shm "$ARM64_ROOT/dev/shm" ;;
        esac
        MOUNTED+=("$ARM64_ROOT/$t")
    done
    # qemu-user 7.2 passes the host's (x86) /proc/cpuinfo through, and the cpuinfo library inside
    # onnxruntime then finds no ARM processor and crashes on import (SIGSEGV). Show the programs
    # what an arm64 kernel shows for $QEMU_CPU cores instead (qemu 8.1 and later emulate the file).
    if ! grep -q '^CPU implementer' "$ARM64_ROOT/proc/cpuinfo"; then
        local i n
        n=$(nproc)
        for ((i = 0; i < n; i++)); do
            printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\nCPU implementer\t: 0x41\n' "$i" "$CPU_FEATURES"
            printf 'CPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: 1\n\n' "$CPU_VARIANT" "$CPU_PART"
        done >"$ARM64_ROOT.cpuinfo"
        mount --bind "$ARM64_ROOT.cpuinfo" "$ARM64_ROOT/proc/cpuinfo"
        MOUNTED+=("$ARM64_ROOT/proc/cpuinfo")
    fi
}
in_root() {  # run a shell command in the root with a clean environment
    chroot "$ARM64_ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
        PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        QEMU_CPU="$QEMU_CPU" DEBIAN_FRONTEND=noninteractive PIP_CERT=/etc/ssl/host-ca.crt PIP_DEFAULT_TIMEOUT=180 \
        PIP_DISABLE_PIP_VERSION_CHECK=1 /bin/bash -c "$1"
}

if [ "${FRESH:-0}" = 1 ] && [ -d "$ARM64_ROOT" ]; then
    step "FRESH=1: removing $ARM64_ROOT"
    umount_all
    for t in dev/shm dev/pts dev sys proc; do umount -l "$ARM64_ROOT/$t" 2>/dev/null || true; done
    rm -rf --one-file-system "$ARM64_ROOT"
fi
if [ ! -e "$ARM64_ROOT/.edgeinfer-stage2-done" ]; then
    if [ ! -e "$ARM64_ROOT/.edgeinfer-stage1-done" ]; then
        step "debootstrap --foreign $SUITE arm64 (first stage, native) -> $ARM64_ROOT"
        rm -rf --one-file-system "$ARM64_ROOT"
        debootstrap --arch=arm64 --foreign --variant=minbase "$SUITE" "$ARM64_ROOT" "$MIRROR" \
            >"$LOG_DIR/debootstrap-1.log" 2>&1 || die "debootstrap first stage failed: $LOG_DIR/debootstrap-1.log"
        touch "$ARM64_ROOT/.edgeinfer-stage1-done"
    fi
    install_interp
    step "debootstrap --second-stage (emulated)"
    chroot "$ARM64_ROOT" /debootstrap/debootstrap --second-stage >"$LOG_DIR/debootstrap-2.log" 2>&1 \
        || die "debootstrap second stage failed: $LOG_DIR/debootstrap-2.log"
    touch "$ARM64_ROOT/.edgeinfer-stage2-done"
fi
install_interp
cp -L /etc/resolv.conf "$ARM64_ROOT/etc/resolv.conf" 2>/dev/null || true
# the host's CA bundle (it holds any CA a TLS-inspecting proxy on the way to PyPI uses)
mkdir -p "$ARM64_ROOT/etc/ssl"
cp -L /etc/ssl/certs/ca-certificates.crt "$ARM64_ROOT/etc/ssl/host-ca.crt"
mount_fs

# -- 4. packages inside the root -------------------------------------------------------------------
if [ ! -e "$ARM64_ROOT/.edgeinfer-packages-done" ]; then
    step "apt-get install python3 python3-venv python3-dev gcc libc6-dev (emulated)"
    printf 'deb %s %s main\ndeb %s %s-updates main\n' "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" \
        >"$ARM64_ROOT/etc/apt/sources.list"
    in_root "apt-get update -q && apt-get install -y -q --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates" >"$LOG_DIR/root-apt.log" 2>&1 \
        || die "apt-get in the root failed: $LOG_DIR/root-apt.log"
    touch "$ARM64_ROOT/.edgeinfer-packages-done"
fi

# -- 5. the source ---------------------------------------------------------------------------------
step "copy the working tree to $ARM64_ROOT/src/edgeinfer"
rm -rf "$ARM64_ROOT/src/edgeinfer"
mkdir -p "$ARM64_ROOT/src/edgeinfer"
REV=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git -C "$REPO" status --porcelain 2>/dev/null | wc -l)
(cd "$REPO" && git ls-files -z -co --exclude-standard \
    | tar --null --verbatim-files-from -T - --ignore-failed-read -cf - 2>/dev/null) \
    | tar -xf - -C "$ARM64_ROOT/src/edgeinfer"

# -- 6. venv and install ---------------------------------------------------------------------------
if [ ! -x "$ARM64_ROOT/opt/venv/bin/python" ]; then
    step "python3 -m venv /opt/venv; pip install -U pip (emulated)"
    in_root "python3 -m venv /opt/venv && python -m pip install -q --upgrade pip" \
        >"$LOG_DIR/venv.log" 2>&1 || die "venv failed: $LOG_DIR/venv.log"
fi
step "pip install -v -e .[test] (emulated; compiles the sampler extension)"
in_root 'cd /src/edgeinfer && pip install -v -e ".[test]"' >"$LOG_DIR/pip-install.log" 2>&1 \
    || die "pip install failed: $LOG_DIR/pip-install.log"

# -- 7. the C extension ----------------------------------------------------------------------------
step "check the C extension"
in_root 'cd /src/edgeinfer && python -c "
import platform, sys, numpy, onnxruntime, edgeinfer.sampling as s
print(\"machine\", platform.machine())
print(\"python\", sys.version.split()[0])
print(\"numpy\", numpy.__version__, \"onnxruntime\", onnxruntime.__version__)
print(\"BACKEND\", s.BACKEND)
print(\"extension\", getattr(s._csampler, \"__file__\", None))
"' >"$LOG_DIR/backend.txt" 2>&1 || true
cat "$LOG_DIR/backend.txt"
BACKEND=$(sed -n 's/^BACKEND //p' "$LOG_DIR/backend.txt")

# -- 8. tests --------------------------------------------------------------------------------------
args=""
[ $# -gt 0 ] && args=$(printf ' %q' "$@")
step "python -m pytest$args (emulated)"
t0=$(date +%s)
set +e
in_root "cd /src/edgeinfer && python -m pytest -p no:cacheprovider -rfEs --durations=20 --junitxml=/tmp/arm64-junit.xml$args" \
    >"$LOG_DIR/pytest.log" 2>&1
rc=$?
set -e
t1=$(date +%s)
cp "$ARM64_ROOT/tmp/arm64-junit.xml" "$LOG_DIR/junit.xml" 2>/dev/null || true

# -- summary ---------------------------------------------------------------------------------------
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "source: $REPO at $REV ($DIRTY changed or untracked paths)"
    echo "root: $ARM64_ROOT, Debian $(cat "$ARM64_ROOT/etc/debian_version") ($SUITE, arm64), $(in_root 'uname -m')"
    echo "emulation: $($QEMU --version | head -1), QEMU_CPU=$QEMU_CPU; $BINFMT_NOTE"
    echo "cpuinfo: $(mountpoint -q "$ARM64_ROOT/proc/cpuinfo" && echo "stand-in bind-mounted on the root's /proc/cpuinfo (MIDR part $CPU_PART)" || echo "the emulator's own")"
    echo "gcc: $(in_root 'gcc --version | head -1')"
    sed 's/^/  /' "$LOG_DIR/backend.txt"
    echo "C extension: $([ "$BACKEND" = c ] && echo built and loaded || echo "NOT built, see $LOG_DIR/pip-install.log"), compiler warnings: $(grep -c 'warning:' "$LOG_DIR/pip-install.log" || true)"
    echo "pytest$args: exit $rc after $((t1 - t0)) s"
    grep -E '^(FAILED|ERROR|SKIPPED) ' "$LOG_DIR/pytest.log" | sed 's/^/  /' || true
    echo "  $(tail -1 "$LOG_DIR/pytest.log")"
} | tee "$LOG_DIR/summary.txt"
[ "$BACKEND" = c ] || exit 2
exit "$rc"
