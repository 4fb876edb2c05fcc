"""The models a config serves, each as the one-model ``Config`` its child is prepared and launched from.

``models: []`` (the default and every config written before ``models:`` existed) serves the ``llama:``
section's one model, always resident, under ``llama.model.alias`` plus ``proxy.model_aliases``: the
single-model daemon, unchanged. Each ``models[]`` entry is the ``llama:`` section with that entry's
non-null fields put over it, so ``prepare``, the budget, ``launch`` and the driver work per model
exactly as they do for one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from supervisor.config.schema import Config, ModelConfig, ServedModelConfig, overrides


@dataclass(frozen=True)
class ServedModel:
    name: str
    aliases: tuple[str, ...]
    residency: str  # "always" | "on_demand"
    idle_unload_s: float | None  # None: never unloaded for idleness (always resident)
    cfg: Config  # a one-model config: cfg.llama is this model's child
    load_wait_s: float = 300.0  # on_demand: how long a request waits for the load
    preload: bool = False  # on_demand: also loaded when the daemon starts

    @property
    def on_demand(self) -> bool:
        return self.residency == "on_demand"


def is_multi(cfg: Config) -> bool:
    return bool(cfg.models)


def served_models(cfg: Config) -> tuple[ServedModel, ...]:
    if not cfg.models:
        alias = cfg.llama.model.alias
        return (ServedModel(alias, cfg.proxy.model_aliases, "always", None, cfg),)
    return tuple(_one(cfg, entry) for entry in cfg.models)


def _one(cfg: Config, entry: ServedModelConfig) -> ServedModel:
    model = ModelConfig(path=entry.path, sha256=entry.sha256, alias=entry.name)
    llama = replace(cfg.llama, model=model, **overrides(entry))
    # The child knows one alias (its name); the proxy maps the other names to it.
    one = replace(cfg, llama=llama, models=(), proxy=replace(cfg.proxy, model_aliases=entry.aliases))
    idle = entry.idle_unload_s if entry.residency == "on_demand" else None
    return ServedModel(
        entry.name, entry.aliases, entry.residency, idle, one, entry.load_wait_s, entry.preload
    )


def as_model_path(message: str, index: int) -> str:
    """A problem found on a model's one-model config, named by the ``models[]`` path the operator wrote
    (``llama.model.path: ...`` -> ``models[1].path: ...``)."""
    for field in ("path", "sha256"):
        prefix = f"llama.model.{field}:"
        if message.startswith(prefix):
            return f"models[{index}].{field}:" + message[len(prefix) :]
    return message
