"""Which globals a cell takes along, and which of them are actually sent."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from skyward_jupyter import capture
from skyward_jupyter.capture import Shipper, names_read
from skyward_jupyter.results import PoolError

CELL = """
import torch as T, os.path
x = 1
def f(a):
    b = a + y
    global g
    g = 2
    return lambda q: q + z
for i in range(3):
    pass
[k for k in w]
x += h
del gone
"""


def test_names_read_include_nested_scopes() -> None:
    read = names_read(CELL)
    assert {"y", "z", "w", "h", "gone", "x", "range"} <= read
    assert "T" not in read and "f" not in read


def _ns(**values: Any) -> dict[str, Any]:
    return {"__name__": "__main__", "In": [], "_": None, **values}


def test_only_names_the_notebook_defines_travel() -> None:
    """Its own, also those it starts with ``_``; not IPython's history (``_``, ``_7``,
    ``_i7``, ``_oh``...) nor Python's dunders.
    """
    shipper = Shipper()
    ns = _ns(y=1, z=2, unrelated=3, _private=4, __=5, _7=6, _i7="1", _ii="2", _oh={})
    ns["__version__"] = "1.0"
    cell = "f = lambda: y + z + _private + undefined_here + _ + __ + _7 + _i7 + _ii + _oh"
    shipment = shipper.prepare(cell + " + __name__ + __version__", ns)
    assert set(shipment.globals) == {"y", "z", "_private", "__version__"}


def test_unchanged_values_are_not_sent_again_and_changed_ones_are() -> None:
    shipper = Shipper()
    ns = _ns(data=np.arange(1000))
    first = shipper.prepare("data.sum()", ns)
    assert set(first.globals) == {"data"} and first.nbytes >= 8000
    shipper.commit(first, frozenset())
    second = shipper.prepare("data.sum()", ns)
    assert second.globals == {} and second.unchanged == ("data",) and second.nbytes == 0
    ns["data"][0] = 42  # changed in place: same object, new content
    third = shipper.prepare("data.sum()", ns)
    assert set(third.globals) == {"data"}


def test_names_bound_on_the_ranks_stay_remote() -> None:
    shipper = Shipper()
    shipper.commit(shipper.prepare("model = 1", _ns()), frozenset({"model"}))
    shipment = shipper.prepare("model + 1", _ns(model="notebook's"))
    assert shipment.globals == {} and shipment.remote == ("model",)
    forced = shipper.prepare("", _ns(model="notebook's"), force=frozenset({"model"}))
    assert set(forced.globals) == {"model"}
    shipper.commit(shipper.prepare("data", _ns(data=1)), frozenset())
    shipper.forget(frozenset({"late"}))  # some ranks were lost: the others keep their names
    survivors = shipper.prepare("model + late + data", _ns(model=1, late=2, data=1))
    assert set(survivors.globals) == {"data"} and set(survivors.remote) == {"model", "late"}
    shipper.forget()  # every rank was lost
    assert set(shipper.prepare("model", _ns(model=1)).globals) == {"model"}


def test_a_name_the_ranks_deleted_is_sent_again_and_kept_where_still_their_own() -> None:
    """``del x`` on the ranks: a sent name goes again, unchanged or not, to a cell that reads
    it, with ``fill`` (only the ranks that lack it bind it: the others may have changed theirs in
    place); one the ranks had bound goes with ``keep`` (a rank that deleted it binds it, one that
    still holds its own keeps that). Once there, it is unchanged again.
    """
    shipper = Shipper()
    shipper.commit(shipper.prepare("x", _ns(x=5)), frozenset())
    shipper.commit(shipper.prepare("del x", _ns(x=5)), frozenset(), deleted=frozenset({"x"}))
    again = shipper.prepare("x", _ns(x=5))
    assert set(again.globals) == {"x"} and again.fill == ("x",) and again.keep == ()
    shipper.commit(again, frozenset())
    assert shipper.prepare("x", _ns(x=5)).unchanged == ("x",)
    shipper.commit(shipper.prepare("del x", _ns(x=5)), frozenset(), deleted=frozenset({"x"}))
    edited = shipper.prepare("x", _ns(x=6))  # the notebook's changed: every rank takes it
    assert set(edited.globals) == {"x"} and edited.fill == ()
    shipper.commit(shipper.prepare("y = 1", _ns()), frozenset({"y"}))
    shipper.commit(shipper.prepare("del y", _ns()), frozenset(), deleted=frozenset({"y"}))
    kept = shipper.prepare("y", _ns(y="notebook's"))
    assert set(kept.globals) == {"y"} and kept.keep == ("y",) and kept.remote == ()
    assert kept.fill == ()
    shipper.commit(shipper.prepare("z = 1", _ns()), frozenset({"z"}))
    shipper.forget(frozenset(), deleted=frozenset({"z"}))  # a rank lost in the cell that deleted z
    lost = shipper.prepare("z", _ns(z="notebook's"))
    assert set(lost.globals) == {"z"} and lost.keep == ("z",) and lost.remote == ()


def test_a_rank_started_again_makes_sent_values_go_again_and_bound_names_stay() -> None:
    shipper = Shipper()
    shipper.note_ranks_started(2)  # the pool as the shipper first hears of it: nothing to forget
    shipper.commit(shipper.prepare("x", _ns(x=5)), frozenset())
    shipper.commit(shipper.prepare("y = 1", _ns()), frozenset({"y"}))
    shipper.note_ranks_started(2)
    assert shipper.prepare("x", _ns(x=5)).unchanged == ("x",)
    shipper.note_ranks_started(3)  # a rank lost while idle, started again
    again = shipper.prepare("x + y", _ns(x=5, y=0))
    assert set(again.globals) == {"x"} and again.remote == ("y",)
    assert again.fill == ("x",)  # the ranks that were not lost keep what they made of it


def test_globals_that_share_tensors_travel_together_and_share_them_on_arrival() -> None:
    """A model and the optimizer over its parameters: pickled apart, each would arrive with its
    own copy (the optimizer stepping parameters the model does not hold). Sent in one cell,
    they travel as one value; a function that reads the model, and unrelated globals, stay
    apart (a function's globals are the rank's own there).
    """
    import torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> object:
        return model.weight

    shipper = Shipper()
    ns = _ns(model=model, opt=opt, step=step, other=np.arange(3), n=5, m=5)
    shipment = shipper.prepare("model, opt, step, other, n, m", ns)
    sent = shipment.globals
    assert sent["model"] is sent["opt"]
    assert len({id(v) for v in sent.values()}) == 5  # step, other, n and m: apart
    arrived = sent["model"].load().values
    assert arrived["opt"].param_groups[0]["params"][0] is arrived["model"].weight
    assert shipment.warnings == ()
    shipper.commit(shipment, frozenset())
    assert shipper.prepare("model, opt", ns).globals == {}  # unchanged: not sent again
    ns["step"] = lambda: model.bias  # an edited function: no word of the model
    assert shipper.prepare("model, step", ns).warnings == ()
    ns["opt"] = torch.optim.SGD(model.parameters(), lr=0.01)  # a new optimizer, the same model
    ns["sched"] = torch.optim.lr_scheduler.StepLR(ns["opt"], 1)
    partly = shipper.prepare("model, opt, sched", ns)
    assert (
        set(partly.globals) == {"opt", "sched"} and partly.globals["opt"] is partly.globals["sched"]
    )
    assert any("'opt' and 'sched' share tensors with 'model'" in w for w in partly.warnings)


def test_a_value_sent_over_a_model_the_ranks_hold_says_so_when_the_cell_reads_only_it() -> None:
    """An optimizer made in the notebook over a model the ranks hold, in a cell that reads the
    optimizer alone: it arrives over a copy of the notebook's model, and the cell says so. A
    model the notebook sent is the notebook's on the ranks (push both); one a cell bound there
    is the ranks' own (make the optimizer there, or push both to replace it).
    """
    import torch

    for how in ("sent", "bound", "partly"):
        shipper = Shipper()
        model = torch.nn.Linear(4, 1)
        ns = _ns(model=model)
        if how == "sent":
            shipper.commit(shipper.prepare("model", ns), frozenset())
        else:
            every_rank = how == "bound"
            shipper.commit(shipper.prepare("model = 1", _ns()), frozenset({"model"}), every_rank)
        ns["opt"] = torch.optim.SGD(model.parameters(), lr=0.1)
        # (A cell that reads both sends a partly bound model with the optimizer, to be kept.)
        for cell in ("opt.param_groups", "model, opt")[: 1 + (how != "partly")]:
            shipment = shipper.prepare(cell, ns)
            assert set(shipment.globals) == {"opt"}, (how, cell)
            (said,) = shipment.warnings
            assert "'opt' shares tensors with" in said and "%sky push model opt" in said, said
            if how == "sent":
                assert "'model', which the ranks hold from an earlier cell" in said, said
            else:
                assert "the notebook's 'model', but the ranks' is their own" in said, said
                assert "make them together in a %%sky cell" in said, said
        ns["batch"] = torch.ones(3)  # its own tensors: nothing to say
        assert shipper.prepare("batch", ns).warnings == (), how


def test_a_model_sent_alone_over_the_optimizer_the_ranks_hold_says_so() -> None:
    """The notebook's model changed in place and sent alone: the ranks' optimizer, which they
    hold over their copy, would not step what arrives. A rank started again since lacks the
    model, but the others still hold it: a new optimizer over it is said all the same.
    """
    import torch

    model = torch.nn.Linear(4, 1)
    ns = _ns(model=model, opt=torch.optim.Adam(model.parameters()))
    shipper = Shipper()
    shipper.commit(shipper.prepare("model, opt", ns), frozenset())
    with torch.no_grad():
        model.weight.add_(1.0)
    alone = shipper.prepare("model", ns)
    assert set(alone.globals) == {"model"}
    assert any("'model' shares tensors with 'opt'" in w for w in alone.warnings), alone.warnings
    shipper.commit(alone, frozenset())
    shipper.note_ranks_started(2)
    shipper.note_ranks_started(3)  # a rank lost while idle, started again
    ns["opt"] = torch.optim.SGD(model.parameters(), lr=0.1)
    again = shipper.prepare("opt", ns)
    assert any("'opt' shares tensors with 'model'" in w for w in again.warnings), again.warnings


def test_a_model_sent_again_to_a_restarted_rank_gives_no_word_of_its_optimizer() -> None:
    """After a rank was started again, an unchanged model goes only to the rank that lacks it
    (a fill): the others keep theirs and the optimizer over it, so pushing both, which would
    replace the model they trained, is not advised.
    """
    import torch

    model = torch.nn.Linear(4, 1)
    ns = _ns(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))
    shipper = Shipper()
    shipper.commit(shipper.prepare("model, opt", ns), frozenset())
    shipper.note_ranks_started(2)
    shipper.note_ranks_started(3)  # a rank lost while idle, started again
    refill = shipper.prepare("model", ns)
    assert refill.fill == ("model",) and refill.warnings == ()


def test_sharing_with_unread_globals_is_looked_for_without_pickling_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Looking for what a value sends shares with the globals the ranks hold that the cell does
    not read pickles none of them (a list of tensors or strings, pickled each cell, could take
    longer than the cell), and a bare tensor or array sent (a batch) starts no look at all.
    """
    import torch

    model = torch.nn.Linear(4, 1)
    ns = _ns(texts=["a"] * 10, tensors=[torch.ones(2)], model=model)
    shipper = Shipper()
    shipper.commit(shipper.prepare("texts, tensors, model", ns), frozenset())
    pickled: list[str] = []
    real = capture.pickle_global

    def counted(name: str, value: Any, noting: list[Any] | None = None) -> Any:
        pickled.append(name)
        return real(name, value, noting)

    looked: list[Any] = []
    arrays_in = capture._arrays_in

    def seen(value: Any) -> list[Any] | None:
        looked.append(value)
        return arrays_in(value)

    monkeypatch.setattr(capture, "pickle_global", counted)
    monkeypatch.setattr(capture, "_arrays_in", seen)
    for step in range(2):
        ns["batch"] = np.full(3, step)  # a new batch each cell
        shipper.commit(shipper.prepare("batch", ns), frozenset())
    assert pickled == ["batch", "batch"] and looked == []
    ns["pair"] = (np.ones(2), model.weight)
    assert any(
        "'pair' shares tensors with 'model'" in w for w in shipper.prepare("pair", ns).warnings
    )
    assert pickled[2:] == ["pair"] and any(value is model for value in looked)


def test_names_a_cell_bound_on_some_ranks_are_sent_to_be_kept_where_bound() -> None:
    shipper = Shipper()
    shipper.commit(shipper.prepare("x = 1", _ns()), frozenset({"x"}), every_rank=False)
    some = shipper.prepare("x", _ns(x="notebook's"))
    assert set(some.globals) == {"x"} and some.keep == ("x",) and some.remote == ()
    shipper.commit(some, frozenset())
    assert shipper.prepare("x", _ns(x="notebook's")).unchanged == ("x",)
    shipper.commit(shipper.prepare("x = 2", _ns()), frozenset({"x"}))  # now on every rank
    assert shipper.prepare("x", _ns(x="notebook's")).remote == ("x",)


def test_a_ranks_cell_leaves_what_was_sent_to_the_other_ranks_alone() -> None:
    """Sent before, then rebound by a ``--ranks`` cell: the other ranks keep what they made of
    the sent value (not sent again while the notebook's is unchanged), and get an edit.
    """
    shipper = Shipper()
    shipper.commit(shipper.prepare("hist", _ns(hist=[])), frozenset())
    shipper.commit(shipper.prepare("hist = 1", _ns(hist=[])), frozenset({"hist"}), every_rank=False)
    assert shipper.prepare("hist", _ns(hist=[])).unchanged == ("hist",)
    edited = shipper.prepare("hist", _ns(hist=[1]))
    assert set(edited.globals) == {"hist"} and edited.keep == ("hist",)


def test_a_name_some_ranks_bound_whose_notebook_value_cannot_travel_stays_theirs() -> None:
    import threading

    shipper = Shipper()
    shipper.commit(shipper.prepare("lock = 1", _ns()), frozenset({"lock"}), every_rank=False)
    shipment = shipper.prepare("lock", _ns(lock=threading.Lock()))
    assert shipment.globals == {} and shipment.remote == ("lock",)


def test_a_pushed_name_some_ranks_bound_is_every_ranks_after() -> None:
    shipper = Shipper()
    shipper.commit(shipper.prepare("x = 1", _ns()), frozenset({"x"}), every_rank=False)
    pushed = shipper.prepare("", _ns(x="notebook's"), force=frozenset({"x"}))
    assert set(pushed.globals) == {"x"} and pushed.keep == ()
    shipper.commit(pushed, frozenset())
    shipper.pushed(["x"])
    assert shipper.prepare("x", _ns(x="edited")).remote == ("x",)


def test_names_a_ranks_cell_bound_stay_partly_theirs_when_a_rank_is_lost() -> None:
    shipper = Shipper()
    shipper.forget(frozenset({"x"}), every_rank=False)
    some = shipper.prepare("x", _ns(x="notebook's"))
    assert set(some.globals) == {"x"} and some.keep == ("x",)


def test_the_shells_own_names_stay_in_the_notebook_until_the_notebook_binds_them() -> None:
    """What a real IPython shell put in its namespace (its ``open``, ``In``, ``Out``,
    ``exit``, ``get_ipython``) stays here; a builtin bound to its own name too; a name the
    notebook bound itself travels, also one the shell had used, and so does what a startup
    file defined (the shell hides those names too, as it hides its own).
    """
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    ns, hidden = shell.user_ns, shell.user_ns_hidden
    cell = "open('x'); In; Out; exit; quit; get_ipython(); print; open; helper(2)"
    assert {"open", "In", "Out", "exit", "get_ipython"} <= set(hidden)
    shell.push({"helper": _startup_helper}, interactive=False)  # as a startup file's names are
    assert hidden["helper"] is _startup_helper
    ns["print"] = print
    try:
        assert set(Shipper(hidden).prepare(cell, ns).globals) == {"helper"}
        shell.run_cell("def open(path):\n    return path\nexit = 'mine'", store_history=False)
        assert set(Shipper(hidden).prepare(cell, ns).globals) == {"open", "exit", "helper"}
    finally:
        ns.update({"open": hidden["open"], "exit": hidden["exit"]})
        shell.drop_by_id({"helper": _startup_helper})
        del ns["print"]


def _startup_helper(x: int) -> int:
    return x * 2


def test_functions_take_the_globals_they_use() -> None:
    ns = _ns(LR=0.1, unused=5)
    exec("def step(x):\n    return x * LR\nclass Opt:\n    def rate(self):\n        return LR", ns)
    assert set(Shipper().prepare("step(1)", ns).globals) == {"step", "LR"}
    assert set(Shipper().prepare("Opt().rate()", ns).globals) == {"Opt", "LR"}


def test_an_unpicklable_global_is_named() -> None:
    with pytest.raises(PoolError, match=r"global 'lock' \(lock\) cannot be sent"):
        Shipper().prepare("lock.acquire()", _ns(lock=threading.Lock()))


def test_a_large_global_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture, "LARGE_GLOBAL_BYTES", 1000)
    shipment = Shipper().prepare("big", _ns(big=np.zeros(10_000)))
    assert len(shipment.warnings) == 1 and "'big'" in shipment.warnings[0]


def _sent_again(shipper: Shipper, ns: dict[str, Any], cell: str) -> set[str]:
    shipment = shipper.prepare(cell, ns)
    shipper.commit(shipment, frozenset())
    return set(shipment.globals)


def test_an_unchanged_large_array_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    digest = capture._digest
    monkeypatch.setattr(capture, "_digest", lambda p: read.append("read") or digest(p))
    shipper, ns = Shipper(), _ns(big=np.random.default_rng(0).random(1 << 18))
    assert _sent_again(shipper, ns, "big") == {"big"} and read == ["read"]
    for _ in range(3):
        assert _sent_again(shipper, ns, "big") == set()
    assert read == ["read"], "an unchanged array's buffers were hashed again"
    ns["big"][-1] = 7.0  # one element, in place
    assert _sent_again(shipper, ns, "big") == {"big"} and len(read) == 2


def test_an_array_written_every_cell_is_hashed_unwatched() -> None:
    """A watch would cost the notebook a fault per page it writes, for nothing."""
    shipper, ns = Shipper(), _ns(big=np.zeros(1 << 18))
    _sent_again(shipper, ns, "big")
    for step in range(1, 4):
        ns["big"][0] = step
        assert _sent_again(shipper, ns, "big") == {"big"}
        assert shipper._hashed["big"].watch is None, f"watched after {step} changes"
    assert _sent_again(shipper, ns, "big") == set()  # unchanged once: watched from now on
    assert _sent_again(shipper, ns, "big") == set() and shipper._hashed["big"].watch is not None


def test_an_edit_through_an_array_reaches_its_slice_and_the_slice_itself() -> None:
    shipper = Shipper()
    big = np.random.default_rng(1).random(1 << 19)
    ns = _ns(big=big, part=big[100_000:400_000])
    assert _sent_again(shipper, ns, "big, part") == {"big", "part"}
    assert _sent_again(shipper, ns, "big, part") == set()
    big[300_000] = -1.0  # inside part
    ns["mid"] = big[200_000:350_000]  # new: its watch protects the written page again
    assert _sent_again(shipper, ns, "mid") == {"mid"}
    assert _sent_again(shipper, ns, "part") == {"part"}
    assert _sent_again(shipper, ns, "big") == {"big"}, "the write was forgotten for the whole"
    ns["part"][0] = -2.0
    assert _sent_again(shipper, ns, "big, part") == {"big", "part"}
    ns["part"] = big[100_000:400_001]  # same data, one element more: another value
    assert _sent_again(shipper, ns, "big, part") == {"part"}


def test_a_reshaped_array_is_sent_again_though_its_data_is_untouched() -> None:
    shipper, ns = Shipper(), _ns(big=np.zeros(1 << 18))
    _sent_again(shipper, ns, "big")
    ns["big"].shape = (1 << 9, 1 << 9)  # in place: the same buffer, another array
    assert _sent_again(shipper, ns, "big") == {"big"}


def test_an_unchanged_torch_tensor_is_not_read_again_and_an_edited_one_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    read: list[str] = []
    digest = capture._digest
    monkeypatch.setattr(capture, "_digest", lambda p: read.append("read") or digest(p))
    shipper, ns = Shipper(), _ns(t=torch.zeros(1 << 18))
    assert _sent_again(shipper, ns, "t") == {"t"}
    assert _sent_again(shipper, ns, "t") == set() and read == ["read"]
    ns["t"][5] = 1.0
    assert _sent_again(shipper, ns, "t") == {"t"}
    ns["t"].numpy()[6] = 2.0  # through a numpy view: the tensor's version does not move
    assert _sent_again(shipper, ns, "t") == {"t"}
