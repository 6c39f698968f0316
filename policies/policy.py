"""Speculation policies: what each specialist's engine may do, validated by pydantic.

A policy is set in deploy/*.yaml (a deployment's ``user_config``), replaced live by ``serve deploy``
(``reconfigure``) or the admin API, and read once per engine step through ``policies.gate``.
Policies are immutable: a change is a new object (``SpeculationPolicy.merged``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Mode = Literal["on", "off", "auto"]
AcceptanceMethod = Literal["greedy", "rejection", "typical"]

USER_CONFIG_KEY = "speculation"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TypicalAcceptance(_Frozen):
    """Typical acceptance (lossy): keep a draft while p(draft) > min(epsilon, delta * exp(-H(p)))."""

    epsilon: float = Field(0.09, gt=0.0, le=1.0)
    delta: float = Field(0.3, gt=0.0)


class AutoGating(_Frozen):
    """When mode is "auto": stop speculating (fallback) when it does not pay, probe again later."""

    min_acceptance: float = Field(0.1, ge=0.0, le=1.0)  # rolling accepted/drafted below this -> fallback (only with min_speedup 0: else time judges)
    window: int = Field(64, ge=1, le=1_000_000)  # drafted tokens in the rolling window (judged when full)
    max_running_batch: int = Field(8, ge=1)  # running sequences above this -> fallback
    cooldown_s: float = Field(10.0, ge=0.0)  # seconds in fallback before probing again (a slow verdict: / speed-up, <= 8x)
    # > 0: also fall back when speculating emits tokens less than min_speedup times as fast as plain
    # decoding did (seconds per emitted token, per batch-size bucket; the plain figure is measured in
    # fallback, and a first fallback ("baseline", baseline_steps plain steps of that bucket) is taken to
    # measure it). 0: judge acceptance only. On by default: acceptance alone misses the batch sizes
    # where speculation is slower while its drafts are still accepted.
    min_speedup: float = Field(1.0, ge=0.0, le=10.0)
    baseline_steps: int = Field(8, ge=1, le=10_000)  # plain steps that measure a bucket's baseline
    # other K values auto may pick per batch-size bucket, by measured seconds per emitted token (each
    # tried probe_steps steps first, then the fastest, the others probed again every probe_every steps);
    # empty: always num_speculative_tokens
    k_choices: tuple[int, ...] = ()
    probe_steps: int = Field(4, ge=1, le=1000)
    probe_every: int = Field(64, ge=2, le=100_000)

    @field_validator("k_choices")
    @classmethod
    def _ks(cls, ks: tuple[int, ...]) -> tuple[int, ...]:
        if any(not 1 <= k <= 8 for k in ks):
            raise ValueError(f"k_choices must be in 1..8, got {list(ks)}")
        return tuple(sorted(set(ks)))


class SpeculationPolicy(_Frozen):
    """One specialist's speculation policy."""

    mode: Mode = "auto"
    num_speculative_tokens: int = Field(3, ge=1, le=8)
    acceptance: AcceptanceMethod = "rejection"
    typical: TypicalAcceptance = TypicalAcceptance()
    auto: AutoGating = AutoGating()

    def merged(self, patch: Mapping[str, Any]) -> SpeculationPolicy:
        """A new, validated policy: this one with ``patch`` deep-merged over it (a partial update)."""
        return SpeculationPolicy.model_validate(_deep_merge(self.model_dump(), patch))

    @classmethod
    def from_user_config(cls, user_config: Mapping[str, Any] | None) -> SpeculationPolicy:
        """The policy in a deployment's user_config ``{"speculation": {...}}``; defaults when absent.

        Other top-level keys belong to the deployment and are left alone. Raises pydantic's
        ValidationError, located under ``speculation``, for bad values or unknown keys."""
        return _DeploymentUserConfig.model_validate(dict(user_config or {})).speculation

    def to_user_config(self) -> dict[str, Any]:
        """The user_config fragment that ``from_user_config`` reads back."""
        return {USER_CONFIG_KEY: self.model_dump()}


class PolicySet(_Frozen):
    """Policies of a whole ensemble: a default and per-specialist overrides.

    An override is deep-merged over the default, so ``{"default": {"mode": "auto"}, "specialists":
    {"cpp": {"auto": {"cooldown_s": 5}}}}`` gives cpp the default policy with a 5 s cooldown.
    After validation ``specialists`` holds complete policies."""

    default: SpeculationPolicy = SpeculationPolicy()
    specialists: dict[str, SpeculationPolicy] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _merge_overrides(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        default = data.get("default", {})
        overrides = data.get("specialists", {})
        if not isinstance(overrides, Mapping) or not isinstance(default, Mapping | SpeculationPolicy):
            return data  # let field validation report the wrong type
        base = default.model_dump() if isinstance(default, SpeculationPolicy) else dict(default)
        merged = {
            name: o if isinstance(o, SpeculationPolicy) else _deep_merge(base, o) if isinstance(o, Mapping) else o
            for name, o in overrides.items()
        }
        return {**data, "specialists": merged}

    def policy_for(self, specialist: str) -> SpeculationPolicy:
        """The specialist's policy: its override, else the default."""
        return self.specialists.get(specialist, self.default)

    def with_policy(self, specialist: str, policy: SpeculationPolicy) -> PolicySet:
        """A new set in which ``specialist`` has ``policy``."""
        return PolicySet(default=self.default, specialists={**self.specialists, specialist: policy})

    def user_config_for(self, specialist: str) -> dict[str, Any]:
        """The user_config fragment to give the specialist's deployment."""
        return self.policy_for(specialist).to_user_config()

    @classmethod
    def from_user_config(cls, user_config: Mapping[str, Any] | None) -> PolicySet:
        """The set in an ensemble-level config ``{"speculation": {"default": ..., "specialists": ...}}``.

        Raises pydantic's ValidationError, located under ``speculation``, on bad input."""
        return _EnsembleUserConfig.model_validate(dict(user_config or {})).speculation


class _DeploymentUserConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    speculation: SpeculationPolicy = SpeculationPolicy()


class _EnsembleUserConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    speculation: PolicySet = PolicySet()


def _deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` laid over it; nested mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
