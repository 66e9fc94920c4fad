"""Settings of a RaaS worker."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator


class SamplingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, ge=1)


class RaasSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = ""
    """Worker id (consumer name, heartbeat key); default `raas-<host>-<pid>`. Reuse it after a restart
    to take back the entries the previous process held."""
    slots: int = Field(8, ge=1)
    """Prompt groups run concurrently; the worker reads at most its free slots from `prompts`."""
    region: str = "local"
    heartbeat_ms: int = Field(5_000, gt=0)
    """How often the heartbeat hash is refreshed; it expires after three missed beats."""
    grace_s: float = Field(30.0, ge=0)
    """On SIGTERM: how long in-flight groups may finish before the rest is released for others."""
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    workflow_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to workflows (e.g. `chat: true`, `reward: math_verify`)."""
    allowed_code: list[str] = Field(default_factory=list)
    """The user's `module:Name` rewards and workflows that prompt groups (dataset rows) may name, besides
    the registered names, `dataflow.feeder.workflow` and `workflow_options.reward`. A group naming anything
    else is dead-lettered: data never picks the code that runs."""
    accept_pushed_code: bool = False
    """Run workflows pushed to the run (`astraflow workflow push`) whose signature verifies under
    `push_key` for this run. Off: a pushed workflow is never unpickled."""
    push_key: SecretStr | None = None
    """The secret that signs pushed workflows (HMAC-SHA256), held by whoever pushes and by the RaaS that
    accept pushed code, never stored in Redis: set it with `ASTRAFLOW_RAAS__PUSH_KEY`."""
    reward_processes: int = Field(2, ge=1)
    reward_timeout_s: float = Field(10.0, gt=0)
    """A reward call running longer fails its trajectory ("timed out"); importing its module is not counted.
    Its process goes on, unless the call was stopped in an import, or gave no answer within this plus a
    minute (a hang in C): then the reward processes are replaced."""
    sandbox: Literal["namespaces", "none"] = "namespaces"
    """How tool calls are isolated: `namespaces` (where they cannot be made, a worker whose workflow runs
    tools refuses to start, naming why, and any other refuses each tool call), or `none`, which lets tools
    run as the worker's own user where they cannot."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the worker's Prometheus /metrics endpoint (labels run, worker, policy); 0 = not served.
    Two RaaS on one host need two ports."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics endpoint listens on: this host only; `0.0.0.0` (all interfaces) lets a
    Prometheus in another pod scrape it."""

    openai_api: bool = False
    """Serve an OpenAI-compatible endpoint (`/v1/chat/completions`, `/v1/completions`) from this RaaS's
    engines, for the `agent` workflow's programs; a request needs the key of a running episode."""
    openai_host: str = "127.0.0.1"
    """Address the endpoint listens on; keep it on this host unless the agents run elsewhere."""
    openai_port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 = a free port, chosen at start (the agents are told it)."""

    @field_validator("allowed_code")
    @classmethod
    def _module_and_name(cls, refs: list[str]) -> list[str]:
        bad = [r for r in refs if not all(r.partition(":")[::2])]
        if bad:
            raise ValueError(f"not module:Name: {bad}")
        return refs

    @model_validator(mode="after")
    def _push_key_to_accept(self) -> RaasSettings:
        if self.accept_pushed_code and not (self.push_key and self.push_key.get_secret_value()):
            raise ValueError("accept_pushed_code needs push_key (set ASTRAFLOW_RAAS__PUSH_KEY)")
        return self
