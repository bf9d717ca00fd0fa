"""The public surface: ``evenly.__all__`` is short, sorted and true; the names that moved
keep an alias that warns for one release; every string option is a ``Literal``; the
``DataLoader`` takes only ``dataset`` and ``batch_size`` by position; ``evenly.audit`` is
a module whose ``run`` is the Python entry; one setting switches the plan agreement."""

from __future__ import annotations

import inspect
import sys
import typing

import pytest

import evenly
import evenly.core
import evenly.options
import evenly.runtime.detect
from evenly.audit import AuditError

#: Names that moved out of ``evenly`` (still reachable there until 0.3, with a warning).
MOVED = {
    "EpochPlan": evenly.core,
    "FeistelPermutation": evenly.core,
    "Source": evenly.core,
    "Topology": evenly.core,
    "detect_topology": evenly.runtime.detect,
}


def test_all_is_sorted_short_and_every_name_resolves_from_evenly() -> None:
    assert evenly.__all__ == sorted(evenly.__all__)
    assert len(evenly.__all__) <= 21, evenly.__all__
    for name in evenly.__all__:  # warnings are errors here: none of them may warn
        member = getattr(evenly, name)
        assert member is not None, name
        if name == "__version__":
            continue
        home = member.__name__ if inspect.ismodule(member) else member.__module__
        assert home == "evenly" or home.startswith("evenly."), (name, home)
    assert set(evenly.__all__) <= set(dir(evenly))


def test_the_planning_internals_live_in_evenly_core_and_left_the_top_level() -> None:
    assert set(evenly.core.__all__) == {"EpochPlan", "FeistelPermutation", "Source", "Topology"}
    for name in evenly.core.__all__:
        assert getattr(evenly.core, name).__module__.startswith("evenly.core."), name
    assert not set(MOVED) & set(evenly.__all__)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_resolves_from_evenly_with_a_deprecation_warning(name: str) -> None:
    home = MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"evenly\.{name} is deprecated.*{home.__name__}"):
        old = getattr(evenly, name)
    assert old is getattr(home, name)
    with pytest.warns(DeprecationWarning, match=rf"evenly\.{name} is deprecated"):
        exec(f"from evenly import {name}", {})
    with pytest.raises(AttributeError, match=f"has no attribute '{name}s'"):
        getattr(evenly, f"{name}s")


def test_evenly_audit_is_the_module_and_run_its_python_entry() -> None:
    assert evenly.audit is sys.modules["evenly.audit"]
    assert "run" in evenly.audit.__all__ and "audit" not in evenly.audit.__all__
    with pytest.raises(AuditError, match="cannot import module 'nowhere'"):
        evenly.audit.run("nowhere:factory")


def test_calling_the_audit_module_runs_the_audit_with_a_deprecation_warning() -> None:
    with (
        pytest.warns(DeprecationWarning, match=r"calling evenly\.audit\(\.\.\.\).*audit\.run"),
        pytest.raises(AuditError, match="cannot import module 'nowhere'"),
    ):
        evenly.audit("nowhere:factory")  # type: ignore[operator]
    with pytest.warns(DeprecationWarning, match=r"evenly\.audit\.audit is deprecated"):
        old = evenly.audit.audit
    assert old is evenly.audit.run
    with pytest.warns(DeprecationWarning, match=r"evenly\.audit\.audit is deprecated"):
        exec("from evenly.audit import audit", {})


def test_the_data_loader_takes_only_dataset_and_batch_size_by_position() -> None:
    ds = evenly.Dataset(list(range(8)), rank=0, world_size=1)
    parameters = inspect.signature(evenly.DataLoader.__init__).parameters
    positional = [
        n for n, p in parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert positional == ["self", "dataset", "batch_size"]
    with pytest.raises(TypeError, match="positional argument"):
        evenly.DataLoader(ds, 4, 0)  # type: ignore[misc]
    loader = evenly.DataLoader(ds, 4, num_workers=0, drop_last=True)
    assert [len(b) for b in loader] == [4, 4]


def test_agreement_timeout_is_the_one_setting_and_check_plan_warns() -> None:
    ds = evenly.Dataset(list(range(8)), rank=0, world_size=1)
    assert evenly.DataLoader(ds).agreement_timeout == 30.0
    assert evenly.DataLoader(ds, agreement_timeout=5).agreement_timeout == 5.0
    assert evenly.DataLoader(ds, agreement_timeout=None).agreement_timeout is None
    with pytest.warns(DeprecationWarning, match=r"check_plan=\.\.\.\) is deprecated.*=None"):
        off = evenly.DataLoader(ds, check_plan=False)
    assert off.agreement_timeout is None
    with pytest.warns(DeprecationWarning, match=r"check_plan"):
        on = evenly.DataLoader(ds, check_plan=True, agreement_timeout=7)
    assert on.agreement_timeout == 7.0
    with pytest.warns(DeprecationWarning, match=r"DataLoader\.check_plan is deprecated"):
        assert on.check_plan is True
    with pytest.warns(DeprecationWarning, match=r"DataLoader\.check_plan is deprecated"):
        on.check_plan = False
    assert on.agreement_timeout is None
    with pytest.raises(ValueError, match=r"agreement_timeout=\.\.\.\) must be > 0 seconds"):
        evenly.DataLoader(ds, agreement_timeout=0)
    with pytest.raises(TypeError, match=r"agreement_timeout=\.\.\.\) must be a number"):
        evenly.DataLoader(ds, agreement_timeout="30")  # type: ignore[arg-type]


#: ``(callable, parameter)`` -> the ``evenly.options`` alias it is annotated with.
OPTIONS = {
    (evenly.Dataset, "shuffle"): "Shuffle",
    (evenly.Dataset, "pad"): "Pad",
    (evenly.Dataset, "on_error"): "OnError",
    (evenly.Dataset, "seed_generators"): "tuple[Generator, ...] | list[Generator]",
    (evenly.DataLoader, "transport"): "Transport",
    (evenly.DataLoader, "worker_type"): "WorkerType",
    (evenly.BatchSampler, "pad"): "SamplerPad",
    (evenly.Mix, "unit"): "Unit",
    (evenly.Packing, "strategy"): "Strategy",
    (evenly.write, "format"): "Format",
}
#: Parameters with a string default that are names or labels, not a choice of values.
FREE_TEXT = {"field", "text_field", "prefix"}


def _parameters(obj: typing.Any) -> dict[str, inspect.Parameter]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    return dict(inspect.signature(target).parameters)


def test_every_string_option_of_the_public_api_is_a_literal_alias() -> None:
    for (obj, name), alias in OPTIONS.items():
        assert _parameters(obj)[name].annotation == alias, (obj, name)
    public = [getattr(evenly, n) for n in evenly.__all__]
    functions = [o for o in public if inspect.isfunction(o) or inspect.isclass(o)]
    for obj in [*functions, evenly.audit.run]:
        if inspect.isclass(obj) and issubclass(obj, Warning | Exception):
            continue
        for name, parameter in _parameters(obj).items():
            if isinstance(parameter.default, str) and name not in FREE_TEXT:
                assert (obj, name) in OPTIONS, f"{obj.__name__}({name}=...) is a bare str"


#: An alias and a constructor that takes one of its values: the alias's values and the
#: run-time check must agree (``get_args`` of the alias, not a copy of the list).
CHECKED = {
    "Pad": lambda v: evenly.Dataset([1, 2], pad=v, transform=abs),
    "OnError": lambda v: evenly.Dataset([1, 2], on_error=v),
    "SamplerPad": lambda v: evenly.BatchSampler(4, 2, pad=v),
    "Strategy": lambda v: evenly.Packing(4, strategy=v),
    "Unit": lambda v: evenly.Mix({"a": [1]}, unit=v),
    "Transport": lambda v: evenly.DataLoader(evenly.Dataset([1, 2]), transport=v),
    "WorkerType": lambda v: evenly.DataLoader(evenly.Dataset([1, 2]), worker_type=v),
}


@pytest.mark.parametrize("alias", sorted(CHECKED))
def test_each_value_of_an_alias_is_accepted_and_anything_else_named_in_a_value_error(
    alias: str,
) -> None:
    make = CHECKED[alias]
    values = typing.get_args(getattr(evenly.options, alias))
    assert values and all(isinstance(v, str) for v in values), values
    for value in values:
        make(value)
    with pytest.raises(ValueError, match="'nope'") as raised:
        make("nope")
    assert all(repr(v) in str(raised.value) for v in values), str(raised.value)


def test_the_aliases_list_the_values_their_tuples_hold() -> None:
    o = evenly.options
    assert typing.get_args(o.Shuffle) == (bool, typing.Literal["global", "block"])
    assert o.SHUFFLE_MODES == ("none", "global", "block")
    assert typing.get_args(o.Generator) == o.GENERATORS == ("random", "numpy", "torch")
    assert o.FORMATS == ("parquet", "arrow", "webdataset", "jsonl")
    assert set(o.__all__) <= set(dir(o))
