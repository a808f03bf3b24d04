"""Which frameworks a pool sets up on its ranks, and the environment they need there.

torch's process group is formed by default when the ranks have torch; ``--framework jax``
initialises ``jax.distributed`` (the seeds' JAX plugin); ``--framework none`` neither.
``--keras-backend`` sets ``KERAS_BACKEND`` in every rank's starting environment, so it holds
before anything there can import Keras; with ``jax`` it also sets up JAX, which Keras' data
parallelism over several processes needs.

A Hugging Face token is read from the notebook's environment (``HF_TOKEN``, or the variable
``--hf-token-env`` names) each time a rank starts, and set as the rank's ``HF_TOKEN``. It travels
in the rank's environment, which providers send over the rank's channel: never on a command
line, in the registry or in a message. Only the variable's name is part of the pool's spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FRAMEWORKS = ("torch", "jax", "none")
KERAS_BACKENDS = ("jax", "torch", "tensorflow")
HF_TOKEN = "HF_TOKEN"


class FrameworkError(ValueError):
    """Framework options that cannot go together, or a token variable the notebook lacks."""


@dataclass(frozen=True, slots=True)
class Frameworks:
    torch: bool | None = None
    """True: torch must be on the ranks; None: set up when it is; False: not set up."""
    jax: bool = False
    keras_backend: str | None = None
    hf_token_env: str | None = None
    """The notebook's variable that holds the Hugging Face token (None: ``HF_TOKEN``, if set)."""

    @classmethod
    def from_options(
        cls,
        names: tuple[str, ...],
        keras_backend: str | None,
        hf_token_env: str | None,
        user_env: Mapping[str, str],
        notebook_env: Mapping[str, str],
    ) -> Frameworks:
        """Check the options together (before any machine starts) and resolve them."""
        chosen = set(names)
        if "none" in chosen and len(chosen) > 1:
            others = ", ".join(sorted(chosen - {"none"}))
            raise FrameworkError(f"--framework none sets nothing up; it cannot go with {others}")
        if keras_backend == "jax" and "none" in chosen:
            raise FrameworkError("--keras-backend jax needs JAX set up: leave out --framework none")
        given = user_env.get("KERAS_BACKEND")
        if keras_backend and given is not None and given != keras_backend:
            raise FrameworkError(
                f"--env KERAS_BACKEND={given} and --keras-backend {keras_backend} disagree: "
                "give one of them"
            )
        if hf_token_env is not None and hf_token_env not in notebook_env:
            raise FrameworkError(
                f"--hf-token-env {hf_token_env}: the notebook's environment has no "
                f"{hf_token_env}; set it (os.environ[{hf_token_env!r}] = ...) or leave the "
                "option out"
            )
        return cls(
            torch=("torch" in chosen) if chosen else None,
            jax="jax" in chosen or keras_backend == "jax",
            keras_backend=keras_backend,
            hf_token_env=hf_token_env,
        )

    @property
    def forms_worlds(self) -> bool:
        """Whether the ranks form any distributed world (``--framework none``: none)."""
        return self.torch is not False or self.jax

    def agent_settings(self) -> dict[str, Any]:
        """What the rank's agent reads (``SKYWARD_AGENT``): which frameworks to set up."""
        wanted = (["torch"] if self.torch is not False else []) + (["jax"] if self.jax else [])
        default = self.torch is None and not self.jax
        return {"frameworks": None if default else wanted, "keras_backend": self.keras_backend}

    def rank_env(self, has_gpu: bool, notebook_env: Mapping[str, str]) -> dict[str, str]:
        """Variables every rank starts with (``--env`` still wins over them)."""
        env = {}
        if self.keras_backend:
            env["KERAS_BACKEND"] = self.keras_backend
        if self.jax and not has_gpu:
            env["JAX_PLATFORMS"] = "cpu"  # no probing for accelerators the node does not have
        token = notebook_env.get(self.hf_token_env or HF_TOKEN)
        if token:
            env[HF_TOKEN] = token
        return env


TORCH_ONLY = Frameworks()
"""The default: torch's process group, when the ranks have torch."""
