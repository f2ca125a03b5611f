"""The chaos and fuzz harness: `python -m bench.chaos` (issue 29).

It starts a real local cluster (a controller and one worker per island, `cluster.py`), then:

1. fuzz (`fuzz.py`, `messages.py`): hostile requests generated from the protobuf schemas, and
   bytes that are no message, to every method of the controller and of every worker; afterwards
   the controller must be up, its islands, hosts and named slices unchanged, no UNKNOWN status
   from it, no traceback in its log;
2. kills (`kills.py`, `workload.py`): while a program across both islands runs in a loop (each
   result checked), workers and the controller are killed with SIGKILL at random moments and
   started again; per kill the time to a clear error, the time until the cluster serves again,
   calls still waiting `STUCK_S` after the kill, and the controller's state after its restarts;
   Before the first kill, beside those workloads, the proxy fuzz (`proxyfuzz.py`, `proxyreqs.py`):
   a hostile tenant of the IFRT proxy service (what `JAX_PLATFORMS=proxy` programs speak) opens
   sessions refused at their start and sessions that do real work, then sends hostile requests of
   every kind built from the protocol's own descriptors (handles of its own, of its other
   sessions and random ones, Compiles of real and broken StableHLO, sizes that disagree with the
   bytes), undecodable bytes, the host buffer RPCs with random sessions, handles and sizes, and
   clients that never read; no answer may be UNKNOWN or "(a bug)", no workload call may fail or be
   wrong meanwhile, and a fresh proxy session must compute right afterwards;
3. freezes (`freezes.py`), mixed with the kills: a worker or the controller stopped with SIGSTOP
   for a while, short or well past the heartbeat timeout (a worker is then declared lost while
   its process lives, and must rejoin), some with a kill halfway through, then let go with
   SIGCONT; per freeze the time to the host's loss and to a clear error, the time until calls
   succeed again, hosts lost besides, and the database agreeing with the controller.

At the end, once every session ended, no buffer may be left on a worker.

It prints one JSON document (and writes it with `--out`) with a `checks` object: every check
that must hold, true or false; the exit code is 0 when all hold. Runs are seeded (`--seed`): each
phase draws from its own stream, so a seed names the same fault schedule (which process, when,
how long) every time, printed as the report's `schedule` (`schedule.py`).
"""
