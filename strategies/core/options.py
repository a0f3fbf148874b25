"""A strategy's keyword options routed to the configs they belong to: :func:`route_options`."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from tasks.config import ConfigError, fields_of, replace_checked

__all__ = ["route_options"]


def route_options(owner: str, specs: dict[str, Any], algo: str | None, cfg: Any,
                  configs: dict[str, Any], options: dict[str, Any],
                  wrong_algo: Callable[[str, str, Iterable[str]], Exception] | None = None
                  ) -> tuple[str, Any, dict[str, Any]]:
    """``(algo, cfg, configs)`` with every option of ``options`` applied where its name is a
    field: of one of ``configs`` (name -> dataclass instance, e.g. the task config and the round
    policy; replaced, checked against the same ranges and choices as the run config), else of
    the algorithm's config (``specs[algo].build_config``). ``algo``: which of ``specs`` (the
    algorithms ``owner`` runs) runs, default the first; any other is a ``ConfigError``, an
    unknown option a ``TypeError`` that lists the options there are (``wrong_algo(owner, algo,
    specs)``: the error for an ``algo`` not in ``specs``, default a plain ``ConfigError``)."""
    if algo is None:
        algo = next(iter(specs), owner)
    elif specs and algo not in specs:
        if wrong_algo is not None:   # (e.g. the registry's: it names the class that runs ``algo``)
            raise wrong_algo(owner, algo, specs)
        raise ConfigError(f"algo={algo!r} is not run by {owner}; it runs: {', '.join(specs)}")
    names = {target: {f.name for f, _ in fields_of(type(c))} for target, c in configs.items()}
    by_target: dict[str, dict[str, Any]] = {target: {} for target in (*configs, "algo")}
    for name, value in options.items():
        target = next((t for t, fields in names.items() if name in fields), "algo")
        by_target[target][name] = value
    spec = specs.get(algo)
    algo_names = {f.name for f, _ in fields_of(spec.config_cls)} if spec is not None and spec.config_cls else set()
    unknown = sorted(set(by_target["algo"]) - algo_names)
    if unknown:
        others = "; ".join(f"{t}: {', '.join(sorted(n))}" for t, n in names.items())
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"options of algo={algo!r}: {', '.join(sorted(algo_names)) or 'none'}; {others}")
    if spec is not None:
        cfg = spec.build_config(cfg, by_target["algo"])
    out = {t: (replace_checked(c, **by_target[t]) if by_target[t] else c) for t, c in configs.items()}
    return algo, cfg, out
