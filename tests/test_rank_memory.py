"""What a rank holds for a global it is sent: a large ``bytes`` value once, not twice.

Real ranks of a local pool; the peak is the rank's own (``VmHWM``, reset just before the value
is sent), so it counts every copy the rank made on the way, however briefly held.
"""

from __future__ import annotations

from skyward_jupyter import Pool

SIZE = 256 << 20

RESET_PEAK = """
def _status(field):
    with open('/proc/self/status') as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith(field + ':'))
with open('/proc/self/clear_refs', 'w') as refs:
    refs.write('5')  # the peak is the resident size from here on
_held = _status('VmRSS')
"""


def test_a_large_bytes_global_is_held_once_on_every_rank(pool2: Pool) -> None:
    pool2.run(RESET_PEAK).raise_for_errors()
    value = b"\x01" * SIZE
    try:
        result = pool2.run(
            "(type(blob).__name__, len(blob), blob[-1], _status('VmHWM') - _held)",
            {"blob": value},
        ).raise_for_errors()
    finally:
        del value
        pool2.run("del blob, _held, _status").raise_for_errors()
    for kind, size, last, grew in result.values:
        assert (kind, size, last) == ("bytes", SIZE, 1)
        assert grew < 1.3 * SIZE, f"the rank's peak grew by {grew / SIZE:.2f} times the value"
