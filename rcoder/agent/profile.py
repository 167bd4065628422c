"""What a profile means for the agent process it runs: its home, model provider and sandbox.
Settings (rcoder.config) hold the keys; this reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from rcoder.config import AgentProfile, Settings
from rcoder.domain import ModelProvider


def model_provider(profile: AgentProfile, request: ModelProvider) -> ModelProvider:
    """The provider an agent of this profile runs with: the request's, else the profile's."""
    return ModelProvider(
        request.base_url or profile.model_base_url,
        request.api_key or profile.model_api_key,
        request.model or profile.model,
    )


def agent_homes(settings: Settings, profile: AgentProfile) -> Path:
    """``<data_dir>/agents/<profile>``: the folder of the profile's homes, one per project."""
    return (settings.data_dir / "agents" / profile.name).absolute()


def agent_home(settings: Settings, profile: AgentProfile, project_id: str) -> Path:
    """``<data_dir>/agents/<profile>/<project_id>``: the HOME of the profile's agents in that
    project, stable across restarts, never shared with another project (DESIGN §6.1)."""
    return agent_homes(settings, profile) / project_id


def sandbox_of(settings: Settings, profile: AgentProfile) -> Literal["landlock", "none"]:
    """What the profile's agents run under: its ``sandbox``, with "auto" decided by the kernel."""
    if profile.sandbox == "auto":
        return "landlock" if settings.landlock_abi > 0 else "none"
    return profile.sandbox
