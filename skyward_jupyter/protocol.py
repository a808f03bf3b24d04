"""The messages that travel on the wire between the notebook (the pool) and each rank (the agent).

Commands flow down, events flow up. Every message is a frozen dataclass, so both sides read the
same shapes and a protocol change is a change of this one file.

User data (globals, cell values, exceptions) travels inside :class:`Pickled`, a pickle nested in
the message. The nesting keeps a value that cannot be loaded on the receiving side (a module that
is missing there, a class that changed) from making the whole message unreadable: the message
arrives, and only that value reports its error. Its buffers stay out-of-band in the outer frame.
"""

from __future__ import annotations

import io
import operator
import pickle
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, cast, dataclass_transform

import cloudpickle

from . import wire

M = TypeVar("M", bound=type)
V = TypeVar("V")

_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Types whose pickle cannot refer to the notebook's ``__main__``."""
BYTES_APART = 1 << 16
"""A ``bytes`` value from this size travels out of the pickle, so a rank holds it once."""
INLINE_BELOW = 1 << 12
"""A pickled value smaller than this travels inside its message's pickle: the frame is then one
segment, which both sides read and write whole (a cell's value, a small global), where a
segment of its own costs a frame's length table and a read per part."""


class _Bytes:
    """A ``bytes`` value pickled as an out-of-band buffer: the wire reads such a buffer straight
    into a new ``bytes`` object (:mod:`.wire`), which is then the value itself, where an in-band
    pickle would hold the frame and its copy at once (twice the value's size on every rank).
    """

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (_bytes_of, (pickle.PickleBuffer(self.value),))


def _bytes_of(buffer: Any) -> bytes:
    """The value of a :class:`_Bytes`: the received buffer itself when it already is ``bytes``."""
    return buffer if type(buffer) is bytes else bytes(buffer)


def is_array(obj: Any) -> bool:
    """A tensor (a parameter too) or a numpy array: what two globals share that separate pickles
    would split into copies (the parameters of a model and of its optimizer).
    """
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(obj, torch.Tensor)) or (
        type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy"
    )


class Together:
    """Globals that share tensors or arrays (a model, and the optimizer over its parameters),
    pickled as one value so that on the ranks they share them too: pickled apart, each would
    bring its own copy (the optimizer would step parameters the model does not hold).
    """

    __slots__ = ("values",)

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return (Together, (self.values,))


def each_once(values: Iterable[V]) -> list[V]:
    """``values``, each object once (by identity): globals that travel together share one
    value, to be counted, stashed or dropped once.
    """
    return list({id(v): v for v in values}.values())


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]  # cloudpickle has no stubs
    """cloudpickle, with a large CPU tensor's data out of the pickle as numpy's is: pickled
    without a copy, and hashed or watched for writes where it lies (:mod:`.capture`); torch's
    own pickling copies it through ``torch.save``, unchanged or not. With ``noting``, the
    tensors and arrays it meets are noted (held, so that no temporary's id is reused).
    """

    noting: list[Any] | None = None

    def reducer_override(self, obj: Any) -> Any:
        if self.noting is not None and is_array(obj):
            self.noting.append(obj)
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            apart = _tensor_apart(torch, obj)
            if apart is not None:
                return apart
        return super().reducer_override(obj)


def _tensor_apart(torch: Any, t: Any) -> tuple[Any, ...] | None:
    """A plain, dense CPU tensor that alone fills its storage, as its raw bytes and its shape;
    None for any other (torch pickles those, keeping what they carry besides).
    """
    nbytes = t.numel() * t.element_size()
    if (
        nbytes < BYTES_APART
        or t.device.type != "cpu"
        or t.layout is not torch.strided
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or t.grad_fn is not None
        or any(getattr(t, "names", ()))
        or t.__dict__
        or not t.is_contiguous()
        or t.storage_offset()
        or t.untyped_storage().nbytes() != nbytes
    ):
        return None
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()
    dtype = str(t.dtype).removeprefix("torch.")
    return (_tensor_of, (pickle.PickleBuffer(raw), dtype, tuple(t.shape), t.requires_grad))


def _tensor_of(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """The tensor of :func:`_tensor_apart`, over the received buffer (a copy of it when it is
    read-only: torch writes where its tensors lie).
    """
    import torch

    if memoryview(buffer).readonly:
        buffer = bytearray(buffer)
    t = torch.frombuffer(buffer, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_(requires_grad)


@dataclass_transform(frozen_default=True)
def message(cls: M) -> M:
    """A frozen, slotted dataclass that pickles as a call of its constructor (and travels on the
    wire as its name and fields).

    A slotted dataclass otherwise pickles through Python-level ``__getstate__`` and
    ``__setstate__`` that list its fields each time: on the hottest path, a trivial cell, both
    sides paid that for every message.
    """
    made: type = dataclass(frozen=True, slots=True)(cls)
    names = [f.name for f in fields(made)]
    args: Callable[[object], tuple[Any, ...]] = (
        operator.attrgetter(*names)
        if len(names) > 1
        else lambda self: tuple(getattr(self, name) for name in names)
    )

    def __reduce__(self: object) -> tuple[type, tuple[Any, ...]]:
        return made, args(self)

    setattr(made, "__reduce__", __reduce__)  # noqa: B010 - a method mypy will not let be assigned
    wire.register(made, args)  # on the wire, without naming the class (see :mod:`.wire`)
    return cast(M, made)


def _restore(data: memoryview | bytes, *buffers: memoryview | bytes) -> Pickled:
    return Pickled(data, buffers)


@dataclass(frozen=True, slots=True)
class Pickled:
    """A value pickled once (cloudpickle, protocol 5), loadable on demand."""

    data: bytes | bytearray | memoryview
    buffers: tuple[Any, ...] = ()

    @classmethod
    def dump(cls, obj: object, noting: list[Any] | None = None) -> Pickled:
        """``obj`` pickled; ``noting`` gets the tensors and arrays in it, which another value
        could share (a plain value has none).
        """
        buffers: list[pickle.PickleBuffer] = []
        if type(obj) is bytes and len(obj) >= BYTES_APART:
            data = pickle.dumps(_Bytes(obj), protocol=5, buffer_callback=buffers.append)
            return cls(data, tuple(buffers))
        if type(obj) in _PLAIN:  # most cells' value: the C pickler, not cloudpickle's set-up
            return cls(pickle.dumps(obj, protocol=5))
        with io.BytesIO() as file:
            pickler = _Pickler(file, protocol=5, buffer_callback=buffers.append)
            pickler.noting = noting
            pickler.dump(obj)
            return cls(file.getvalue(), tuple(buffers))

    def load(self) -> Any:
        return pickle.loads(self.data, buffers=self.buffers)

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes + sum(memoryview(b).nbytes for b in self.buffers)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if not self.buffers and memoryview(self.data).nbytes < INLINE_BELOW:
            return (_restore, (bytes(self.data),))
        # A larger payload goes to the outer pickler as PickleBuffers, so the frame carries it
        # out-of-band instead of copying it into the outer pickle stream.
        return (
            _restore,
            (pickle.PickleBuffer(self.data), *(pickle.PickleBuffer(b) for b in self.buffers)),
        )


# ---------------------------------------------------------------- commands (pool -> rank)


@message
class Beat:
    """The notebook's heartbeat; a rank that hears none for a while exits by itself.

    (A rank's own heartbeat is its :class:`Usage`, sent at the same rhythm.)
    """


@message
class FormGroup:
    """Join the pool's worlds: torch.distributed's group, and JAX's when ``jax``. ``port`` and
    ``jax_port`` both None: this rank is the head, which hosts them and says where.

    ``generation`` counts the formations of the pool's group; ``restarts`` those that followed
    a failure, the rank's ``TORCHELASTIC_RESTART_COUNT`` (as torchrun counts restarts).
    ``secret``, fresh for each formation, is what the rendezvous store asks its clients to
    prove: it travels only on the ranks' own channels.
    """

    generation: int
    port: int | None
    secret: bytes = field(repr=False)
    restarts: int = 0
    jax: bool = False
    """Initialise ``jax.distributed`` (once per process: a pool with JAX replaces its ranks)."""
    jax_port: int | None = None


@message
class LeaveGroup:
    """Destroy the process group; peers blocked in a collective with this rank then fail fast."""


@message
class Script:
    """Run the source as a script (``%sky run``): its own ``__main__``, argv and directory."""

    path: str
    argv: tuple[str, ...] = ()
    directory: bool = False
    """``path`` is a directory's ``__main__.py``, run as ``python DIR`` runs it: ``sys.argv[0]``
    is the directory."""


@message
class Relayed:
    """A large value the notebook sent once, to the head; each node's first rank fetches it
    (:class:`Fetch`, see :mod:`.agent.relay`) and checks it against ``digest`` (sha256 hex), and
    the node's ranks share that copy (:mod:`.agent.node_blobs`).
    """

    digest: str
    nbytes: int


@message
class Stash:
    """To the head (or, with no relay, to each node's first rank): keep ``blob`` (its sha256 is
    ``digest``, a frame of :func:`.wire.encode_blob`) for the node's ranks and the relay.
    """

    digest: str
    blob: Pickled


@message
class Drop:
    """To each node's first rank: the ranks have what these blobs held."""

    digests: tuple[str, ...]


@message
class Fetch:
    """To a node's first rank: fetch blob ``digest`` now, from the first of ``sources`` (node,
    address, port) that has it, for the node's ranks and the relay's children.
    """

    digest: str
    nbytes: int
    sources: tuple[tuple[int, str, int], ...]


@message
class SyncFiles:
    """To one rank per node: bring the node's copy of a notebook directory to this state.

    ``entries`` are (path, mode, sha256); ``bundle`` carries the contents the node said it
    lacked (None on the first ask).
    """

    key: str
    root: str
    entries: tuple[tuple[str, int, str], ...]
    bundle: Relayed | None = None


@message
class Workdir:
    """Where a cell runs: per node, the directories to put on ``sys.path`` (the first is the
    working directory).
    """

    paths: dict[int, tuple[str, ...]]
    roots: tuple[str, ...] = ()
    """The notebook's directories the paths stand for (a script's path is mapped through)."""


@message
class RunCell:
    cell_id: int
    source: str
    filename: str
    globals: dict[str, Pickled | Relayed] = field(default_factory=dict)
    script: Script | None = None
    workdir: Workdir | None = None
    run_id: str | None = None
    """A script's ``TORCHELASTIC_RUN_ID``: each ``%sky run`` is a launch of its own, as each
    torchrun is, with a new id unless ``--env`` chose one (None: a cell, in the pool's launch)."""
    keep: tuple[str, ...] = ()
    """Of ``globals``, the names a rank binds only where none of its cells bound them: names some
    ranks bound in a ``--ranks`` cell stay theirs, the others get the notebook's value."""
    fill: tuple[str, ...] = ()
    """Of ``globals``, the names a rank binds only where it lacks them: a name an earlier cell
    deleted on some ranks comes back there, and the others keep what they hold (a model they
    trained in place is not the notebook's any more)."""
    head: int = 0
    """The cell's head: the first rank that runs it (``--ranks 1``: rank 1), whose ``input()``
    the notebook answers."""


def cell_filename(number: int) -> str:
    """The file name a notebook cell runs under on the ranks, which its tracebacks and stacks
    show: ``<In [7]>`` for the notebook's ``In [7]`` (IPython's execution count, the number the
    panel shows).
    """
    return f"<In [{number}]>"


def pool_cell_filename(cell_id: int) -> str:
    """The file name of a cell run outside a numbered notebook cell (``Pool.run``): the pool's
    own count, ``<sky-cell-3>``.
    """
    return f"<sky-cell-{cell_id}>"


def cell_name(filename: str) -> str | None:
    """What a :func:`cell_filename` names: ``In [7]``, or ``cell`` (the pool's count); None
    for any other file (a script, a module).
    """
    if filename.startswith("<In [") and filename.endswith("]>"):
        return filename[1:-1]
    return "cell" if filename.startswith("<sky-cell-") else None


@message
class Interrupt:
    """Raise KeyboardInterrupt in cell ``cell_id`` (SIGINT to the rank's main thread); when it
    arrives before that cell started on the rank, the cell stops as it starts.
    """

    cell_id: int | None = None


@message
class StackRequest:
    """Answer with :class:`Stacks` now (the reader thread answers, also mid-cell)."""

    request: int


@message
class NamesRequest:
    """Answer with :class:`Names` now (the reader thread answers, also mid-cell): the names the
    rank's namespace binds, or the attributes of the object at ``path`` in it.
    """

    request: int
    path: tuple[str, ...] = ()
    """Attribute names from the namespace down (``("model", "fc")``: ``model.fc``'s
    attributes); empty: the namespace's own names."""


@message
class InputReply:
    """The notebook's answer to :class:`InputRequest`: the line typed, or why there is none."""

    text: str | None
    error: str | None = None


@message
class Shutdown:
    """Leave the process group and exit; the node's copy of the synced directories goes with
    the last rank using it, unless ``keep_files``.
    """

    keep_files: bool = False


# ---------------------------------------------------------------- events (rank -> pool)


@message
class Hello:
    """First message of a rank: what it runs on, for version checks and the views."""

    pid: int
    hostname: str
    python: str
    cloudpickle: str
    torch: str | None
    cuda_devices: int
    relay_port: int | None = None
    """The node's relay for large values, on its first rank (None on the others, on the
    notebook's own machine, or when it cannot listen)."""
    jax: str | None = None
    """JAX's version, when the pool asked for JAX (None: not installed, or not asked)."""
    problem: str | None = None
    """What stops this rank from serving the pool as asked (e.g. Keras's backend)."""
    nccl: bool | None = None
    """Whether this rank's torch has NCCL (None: no torch)."""


@message
class Usage:
    """What the rank's process uses, sent with its heartbeat (about once a second)."""

    cpu_percent: float
    rss_bytes: int
    gpu_memory_bytes: int | None
    gpu_utilization: float | None
    waiting: str | None = None
    """The collective the cell waits in and since when, e.g. ``all_reduce at cell line 3``."""
    waited: float = 0.0
    memory_limit_bytes: int | None = None
    """The memory the rank may use: its cgroup's limit, or the machine's when lower or none."""
    oom_record: str | None = None
    """The file on the rank's machine whose ``oom_kill`` counts its cgroup's OOM kills."""
    oom_kills: int | None = None
    """That count when the sample was taken."""


@message
class NodeUsage:
    """The :class:`Usage` of a node's ranks, sent by its first rank about once a second for all
    of them (see :mod:`.agent.node_usage`): the notebook reads one message a node, not a rank.
    Each entry is a rank heard since the last one: its rank, its pid, how many seconds ago its
    sample was taken, and the sample.
    """

    ranks: tuple[tuple[int, int, float, Usage], ...]


@message
class Stacks:
    """Where a rank is: every thread's stack (the cell's first), and the collective the cell's
    thread has waited in for ``waited`` seconds, called from ``where`` (a cell or file line).
    """

    text: str
    collective: str | None = None
    where: str | None = None
    waited: float = 0.0
    request: int = 0


@message
class Name:
    """One name of a rank's namespace, without its value: its type and, for a tensor or an
    array, its shape, dtype and device (None for anything else).
    """

    name: str
    type_name: str
    kind: str
    """What IPython calls its completions: ``module``, ``class``, ``function``, ``instance``
    (an attribute: also ``property``)."""
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None


@message
class Names:
    """The answer to :class:`NamesRequest`: the namespace's names (each a :class:`Name`), or
    an object's attributes (``dir()``, each with its kind, no type), or why not.
    """

    request: int
    names: tuple[Name, ...] = ()
    error: str | None = None


@message
class InputRequest:
    """The head rank's cell asks for a line (``input()``, ``breakpoint()``, pdb)."""

    cell_id: int | None
    prompt: str
    password: bool = False


@message
class GroupPort:
    """The head's rendezvous store listens on ``port`` and JAX's coordinator will on
    ``jax_port`` (None: not set up); the others may now join.
    """

    generation: int
    port: int | None
    jax_port: int | None = None


@message
class GroupState:
    generation: int
    ok: bool
    backend: str | None
    message: str
    earlier: tuple[str, ...] = ()
    """What the rank's namespace built on the group formed before, as ``name (kind)``: their
    next use fails, saying to build them again."""
    rewrapped: tuple[str, ...] = ()
    """The DDP models of the rank's namespace wrapped again on the new group, as ``name (DDP)``."""


@message
class Synced:
    """A node's answer to :class:`SyncFiles`: the contents it lacks, or where the directory now
    is (its copy, or the notebook's own path when the node shares the notebook's files), or an
    error for people.
    """

    key: str
    missing: tuple[str, ...] = ()
    path: str | None = None
    error: str | None = None


@message
class Output:
    cell_id: int | None
    stream: str
    text: str


@message
class Display:
    """Rich output of the cell's head rank (a figure, ``display()``), as a MIME bundle: the
    type's name to its data, in builtins only (text, an image base64-encoded, JSON), as
    Jupyter's messages carry it; ``metadata`` by type (an image's width).
    ``display_id``: shown under that id; ``update``: replaces what was shown under it.
    """

    cell_id: int | None
    data: dict[str, Any]
    metadata: dict[str, Any]
    display_id: str | None = None
    update: bool = False


@message
class Metrics:
    cell_id: int | None
    rows: tuple[tuple[int | None, dict[str, float]], ...]


@message
class ErrorInfo:
    """A remote exception as text (always readable) plus the exception itself when it pickles."""

    type_name: str
    message: str
    traceback: str
    exception: Pickled | None = None
    after_interrupt: bool = False
    """Raised after the pool asked this rank to stop: a consequence of another failure (or of the
    user's interrupt), not the rank's own error."""


@message
class CellDone:
    cell_id: int
    value: Pickled | None
    value_repr: str | None
    error: ErrorInfo | None
    seconds: float
    bound: tuple[str, ...] = ()
    """Global names the cell (re)bound on this rank, also when it failed part-way."""
    group_destroyed: bool = False
    """The cell's code destroyed the default process group: the pool must form it again."""
    notes: tuple[str, ...] = ()
    """What the rank has to tell the user once (e.g. that the pool's group was used)."""
    collectives: tuple[tuple[str, int], ...] | None = ()
    """Each process group's name and how many collectives this rank has called in it (torch's
    sequence number); None: unknown. Ranks that agree on every group can keep it after a
    stop."""
    deleted: tuple[str, ...] = ()
    """Global names the cell deleted on this rank (``del x``): no longer the rank's own."""
    stopped: bool = False
    """The pool's interrupt reached the cell's code here (also when the code caught it)."""


Answer = Hello | CellDone | GroupPort | GroupState | Synced | Stacks | Names
"""What the pool waits for from a rank, each the answer to one request: :class:`Hello` to the
rank's start, :class:`CellDone` to :class:`RunCell`, :class:`GroupPort` (the head's) and
:class:`GroupState` to :class:`FormGroup`, :class:`Synced` to :class:`SyncFiles`,
:class:`Stacks` to :class:`StackRequest`, :class:`Names` to :class:`NamesRequest`."""
ANSWERS = (Hello, CellDone, GroupPort, GroupState, Synced, Stacks, Names)


def request_of(answer: Answer) -> int | str | None:
    """Which request ``answer`` answers, among those of its type a rank may have pending: the
    cell, the formation's generation, the synced directory's key, the stacks or names request;
    None for the one :class:`Hello` of a rank's process.
    """
    if isinstance(answer, CellDone):
        return answer.cell_id
    if isinstance(answer, GroupPort | GroupState):
        return answer.generation
    if isinstance(answer, Synced):
        return answer.key
    if isinstance(answer, Stacks | Names):
        return answer.request
    return None
