"""Per-specialist speculation policies (pydantic) and the runtime gate. A leaf package: it imports
nothing from the project, so the router and the specialists can both read it."""

from policies.gate import GateInputError, RollingAcceptance, SpeculationGate, Status
from policies.policy import (
    USER_CONFIG_KEY,
    AcceptanceMethod,
    AutoGating,
    Mode,
    PolicySet,
    SpeculationPolicy,
    TypicalAcceptance,
)

__all__ = [
    "USER_CONFIG_KEY",
    "AcceptanceMethod",
    "AutoGating",
    "GateInputError",
    "Mode",
    "PolicySet",
    "RollingAcceptance",
    "SpeculationGate",
    "SpeculationPolicy",
    "Status",
    "TypicalAcceptance",
]
