"""Power-aware scheduling: sensors -> `Readings`; a pure `decide(readings, policy, load, previous) -> Plan`;
a `PowerController` that samples off the token path and applies the plan between tokens
(docs/power.md)."""

from edgeinfer.power.controller import PowerController, PowerState
from edgeinfer.power.policy import POLICY_NAMES, Load, Plan, Policy, decide
from edgeinfer.power.readings import PiThrottle, Readings
from edgeinfer.power.sensors import Sensors

__all__ = ["Policy", "Plan", "Load", "decide", "Readings", "PiThrottle", "Sensors", "PowerController",
           "PowerState", "POLICY_NAMES"]
