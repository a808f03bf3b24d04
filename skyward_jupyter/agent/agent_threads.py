"""The names of the threads a rank's agent runs beside the user's code.

The rank ends when one of them dies (it would limp on unwatched), the stacks doctor leaves them
out of what it shows, and the benchmarks count their CPU apart from the training's. No imports:
a torchrun script may read it without loading the agent.
"""

AGENT_THREADS = frozenset(
    {
        "reader",
        "watchdog",
        "capture-stdout",
        "capture-stderr",
        "node-usage",
        "relay",
        "relay-fetch",
        "store",
        "tunnel",
    }
)
