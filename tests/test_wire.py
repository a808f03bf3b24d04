"""Frames: round trips, out-of-band buffers, and clear errors for a wrong peer."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import threading

import numpy as np
import pytest

from skyward_jupyter import protocol as p
from skyward_jupyter import wire
from skyward_jupyter.wire import SyncChannel, WireError, encode, read_message


def _through_asyncio(frame: list[bytes | bytearray | memoryview]) -> object:
    async def go() -> object:
        reader = asyncio.StreamReader()
        for segment in frame:
            reader.feed_data(bytes(segment))
        reader.feed_eof()
        return await read_message(reader)

    return asyncio.run(go())


def test_a_small_pickled_value_travels_inside_its_message() -> None:
    """A cell's value, a small global: the frame is one segment of one part, which the rank's
    channel reads whole (one table entry: the pickle, no buffer beside it).
    """
    message = p.CellDone(3, p.Pickled.dump(42), "42", None, 0.001)
    (frame,) = encode(message)
    assert frame[4:8] == (1).to_bytes(4, "big")  # segments in the frame: the pickle alone
    decoded = _through_asyncio([frame])
    assert isinstance(decoded, p.CellDone) and decoded.value is not None
    assert decoded.value.load() == 42
    reader, writer = os.pipe()
    try:
        channel = SyncChannel(reader, writer)
        channel.send(p.RunCell(4, "x", "<sky-cell-4>", {"x": p.Pickled.dump("small")}))
        assert channel.recv().globals["x"].load() == "small"
    finally:
        os.close(reader)
        os.close(writer)


def test_large_array_travels_out_of_band() -> None:
    array = np.arange(1_000_000, dtype=np.float32)
    frame = encode({"a": array})
    # header, pickle, then the array's own memory as a separate segment: no copy into the pickle
    assert len(frame) == 3
    assert memoryview(frame[2]).nbytes == array.nbytes
    assert memoryview(frame[1]).nbytes < 1000
    assert np.array_equal(_through_asyncio(frame)["a"], array)  # type: ignore[index]


def test_nested_pickled_payload_stays_out_of_band() -> None:
    array = np.ones(500_000)
    message = p.RunCell(1, "x", "<sky-cell-1>", {"x": p.Pickled.dump(array)})
    frame = encode(message)
    assert sum(memoryview(s).nbytes for s in frame[1:2]) < 2000
    decoded = _through_asyncio(frame)
    assert isinstance(decoded, p.RunCell)
    assert np.array_equal(decoded.globals["x"].load(), array)


def test_a_small_array_read_by_the_notebook_arrives_writable() -> None:
    """What the notebook reads from a rank (a cell's value, ``%sky pull``) is the user's to
    change: a small array's buffer was read as ``bytes`` and loaded read-only.
    """
    small = np.arange(10, dtype=np.float64)
    decoded = _through_asyncio(encode(p.Pickled.dump((small, b"kept as bytes"))))
    got, raw = decoded.load()
    got[0] = 7.0  # raises on a read-only array
    assert np.array_equal(got[1:], small[1:]) and raw == b"kept as bytes"


def test_a_large_cpu_tensor_travels_out_of_band_and_arrives_writable() -> None:
    torch = pytest.importorskip("torch")
    weights = torch.rand(300_000, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    grid = torch.rand(600, 500, dtype=torch.float64)
    shipped = {
        name: p.Pickled.dump(t) for name, t in [("w", weights), ("g", grid), ("gt", grid.t())]
    }
    assert [len(shipped[n].buffers) for n in ("w", "g", "gt")] == [1, 1, 0]  # a view: torch's own
    frame = encode(p.RunCell(1, "x", "<sky-cell-1>", shipped))
    assert sum(memoryview(s).nbytes for s in frame[1:2]) < 4000
    decoded = _through_asyncio(frame)
    assert isinstance(decoded, p.RunCell)
    w, g, gt = (decoded.globals[n].load() for n in ("w", "g", "gt"))
    assert w.dtype == torch.bfloat16 and w.requires_grad and w.is_leaf and torch.equal(w, weights)
    assert torch.equal(g, grid) and g.shape == (600, 500) and torch.equal(gt, grid.t())
    g[0, 0] = -1.0  # its memory is its own
    assert grid[0, 0] != -1.0
    received = tuple(bytes(b) for b in shipped["g"].buffers)  # as the relay hands them over
    from_bytes = p.Pickled(shipped["g"].data, received).load()
    from_bytes[0, 0] = -2.0
    assert received[0][:8] == bytes(memoryview(shipped["g"].buffers[0])[:8]), "bytes written"
    assert torch.equal(from_bytes[1:], grid[1:])


def test_sync_channel_round_trip_over_a_pipe() -> None:
    r, w = os.pipe()
    channel = SyncChannel(r, w)
    try:
        channel.send(p.Output(3, "stdout", "hello\r"))
        assert channel.recv() == p.Output(3, "stdout", "hello\r")
    finally:
        os.close(r)
        os.close(w)


def test_a_small_array_arrives_whole_and_writable_over_a_pipe() -> None:
    """A frame split across writes is read whole, and an array loaded from it can be written
    to, as a cell expects of a global it was sent (a read-only buffer would make it read-only).
    """
    r, w = os.pipe()
    array = np.arange(1000, dtype=np.float64)
    channel = SyncChannel(r, -1)
    frame = b"".join(bytes(memoryview(s)) for s in encode({"a": array}))
    try:

        def halves() -> None:
            os.write(w, frame[: len(frame) // 2])
            os.write(w, frame[len(frame) // 2 :])

        writer = threading.Thread(target=halves)
        writer.start()
        got = channel.recv()["a"]
        writer.join()
        assert np.array_equal(got, array)
        got[0] = 7.0  # raises on a read-only array
    finally:
        os.close(r)
        os.close(w)


def test_a_frame_read_ahead_is_said_to_be_pending() -> None:
    """Two frames in one write: after the first, the second is already read here, where a poll
    of the descriptor would not see it (the agent's reader asks before it polls).
    """
    r, w = os.pipe()
    channel = SyncChannel(r, -1)
    try:
        os.write(w, b"".join(bytes(memoryview(s)) for m in (1, 2) for s in encode(p.Interrupt(m))))
        assert not channel.pending()
        assert channel.recv() == p.Interrupt(1)
        assert channel.pending()
        assert channel.recv() == p.Interrupt(2)
        assert not channel.pending()
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("cut", [5, 16, 30])
def test_a_frame_read_in_pieces_arrives_whole(cut: int) -> None:
    """A frame whose first read ends inside its header, at its body, or inside its body (a
    busy writer, a slow link) is read whole, and the next frame after it too.
    """
    (frame,) = encode(p.RunCell(3, "x = 1\n" * 8, "<In [3]>"))
    (after,) = encode(p.Beat())
    assert len(frame) > cut
    r, w = os.pipe()
    channel = SyncChannel(r, -1)
    try:
        os.write(w, frame[:cut])
        channel._fill()  # the first read takes the piece that has come
        os.write(w, frame[cut:] + after)
        assert channel.recv() == p.RunCell(3, "x = 1\n" * 8, "<In [3]>")
        assert channel.recv() == p.Beat()
    finally:
        os.close(r)
        os.close(w)


def test_base64_lines_carry_frames_larger_than_a_pipe() -> None:
    """Slurm's step I/O moves whole lines: a frame travels as base64 lines, one larger than
    the pipe holds arriving over many reads, and what follows it is read after it.
    """
    r, w = os.pipe()
    array = np.arange(300_000, dtype=np.float64)  # a line of 3 MiB
    sender, receiver = SyncChannel(-1, w, lines=True), SyncChannel(r, -1, lines=True)
    try:

        def send() -> None:
            sender.send({"a": array})
            sender.send(p.Beat())

        writer = threading.Thread(target=send)
        writer.start()
        assert np.array_equal(receiver.recv()["a"], array)
        assert receiver.recv() == p.Beat()
        writer.join()
    finally:
        os.close(r)
        os.close(w)


def test_every_message_survives_pickling_as_its_constructor_call() -> None:
    """Messages pickle as a call of their class (see ``protocol.message``): each field comes
    back, whatever the number of fields.
    """
    messages = [
        p.Beat(),
        p.Drop(("ab",)),
        p.Interrupt(4),
        p.CellDone(3, p.Pickled.dump(1), "1", None, 0.5, ("x",), True, ("note",)),
        p.RunCell(2, "y", "<sky-cell-2>", {"y": p.Pickled.dump([1])}, p.Script("s.py", ("-v",))),
    ]
    for message in messages:
        cls, args = message.__reduce__()  # type: ignore[misc]
        assert cls is type(message) and cls(*args) == message
        assert _through_asyncio(encode(message)) == message


def test_wrong_magic_and_version_are_named() -> None:
    frame = encode(p.Beat())
    with pytest.raises(WireError, match="not a skyward_jupyter stream"):
        _through_asyncio([b"XYZ" + bytes(frame[0])[3:], *frame[1:]])
    bumped = bytearray(frame[0])
    bumped[3] = 99
    with pytest.raises(WireError, match="different skyward_jupyter versions"):
        _through_asyncio([bytes(bumped), *frame[1:]])


def test_closed_stream_raises_eof() -> None:
    r, w = os.pipe()
    os.close(w)
    channel = SyncChannel(r, -1)
    try:
        with pytest.raises(EOFError):
            channel.recv()
    finally:
        os.close(r)


def test_sync_channel_sends_a_frame_larger_than_the_pipe_in_many_segments() -> None:
    """More buffers than one ``writev`` takes, and more bytes than the pipe holds (the writer
    blocks while the reader drains it): the frame arrives whole and in order.
    """
    arrays = [np.full(700 + i, i, dtype=np.int32) for i in range(1500)]
    big = np.arange(3_000_000, dtype=np.float64)  # 24 MB
    r, w = os.pipe()
    sender, receiver = SyncChannel(r, w), SyncChannel(r, w)  # one writes, the other reads
    sent = threading.Thread(target=lambda: sender.send({"many": arrays, "big": big}))
    try:
        sent.start()
        got = receiver.recv()
        sent.join(timeout=30)
        assert not sent.is_alive()
        assert len(got["many"]) == 1500
        assert all(np.array_equal(a, b) for a, b in zip(got["many"], arrays, strict=True))
        assert np.array_equal(got["big"], big)
    finally:
        os.close(r)
        os.close(w)


def test_sync_channel_reads_frames_sent_back_to_back() -> None:
    """The reader buffers what the pipe holds: frames written together come out one by one."""
    r, w = os.pipe()
    channel = SyncChannel(r, w)
    try:
        for i in range(50):
            channel.send(p.Output(i, "stdout", f"line {i}\n"))
        assert [channel.recv().cell_id for _ in range(50)] == list(range(50))
    finally:
        os.close(r)
        os.close(w)


def test_an_answer_reaches_only_the_request_it_answers() -> None:
    """Answers are matched to requests by type and request id (``protocol.request_of``), as
    they come off the wire: a late answer to an earlier stacks request, or another cell's
    ``CellDone``, leaves the waiting request alone; its own answer completes it.
    """
    from skyward_jupyter.providers.base import Node
    from skyward_jupyter.ranks import Rank

    def done(cell_id: int) -> p.CellDone:
        return p.CellDone(cell_id, None, None, None, 0.0)

    late = [p.Stacks("earlier", request=1), done(6), p.GroupState(7, True, "gloo", "")]
    own = [p.Stacks("now", request=2), done(7)]
    late, own = ([_through_asyncio(encode(m)) for m in ms] for ms in (late, own))

    async def go() -> None:
        rank = Rank(0, Node(0, "127.0.0.1"), 0, 1)
        stacks, cell = rank.expect(p.Stacks, 2), rank.expect(p.CellDone, 7)
        for answer in late:
            rank.resolve(answer)  # type: ignore[arg-type]
        assert not stacks.done() and not cell.done()
        for answer in own:
            rank.resolve(answer)  # type: ignore[arg-type]
        assert stacks.result().text == "now" and cell.result().cell_id == 7

    asyncio.run(go())


def test_a_message_travels_as_its_name_and_fields_without_naming_a_module() -> None:
    """A cell's frame names no class to import: reading a class from a pickle goes through the
    import system on both sides, each frame, a large share of a trivial cell at many ranks.
    """
    (frame,) = encode(p.RunCell(4, "x", "<sky-cell-4>"))
    assert b"skyward_jupyter" not in bytes(frame)
    assert _through_asyncio([frame]) == p.RunCell(4, "x", "<sky-cell-4>")


def test_a_message_of_a_kind_this_side_lacks_names_the_versions() -> None:
    """A peer of another version may send a kind this side lacks: said, not mistaken."""
    body = pickle.dumps(("MessageFromTheFuture", 1, 2), protocol=5)
    frame = struct.pack("!3sBIQ", b"SKY", wire.VERSION, 1, len(body)) + body
    with pytest.raises(WireError, match="notebook and the ranks run different skyward_jupyter"):
        _through_asyncio([frame])


def test_a_message_of_another_shape_names_the_versions() -> None:
    """A kind this side knows, with fields it does not take (a peer's older protocol)."""
    body = pickle.dumps(("Output", 1, "stdout", "text", "a field too many"), protocol=5)
    frame = struct.pack("!3sBIQ", b"SKY", wire.VERSION, 1, len(body)) + body
    with pytest.raises(WireError, match="message 'Output' of another shape"):
        _through_asyncio([frame])
