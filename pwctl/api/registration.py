"""Program registration over the session stream, and what a resumed session registers again.

A registration is one `RegisterProgram` on the runtime's stream (runtime.py), answered by a
`ProgramRegistered` that the runtime's reader hands here. The programs registered, and the
registrations still unanswered, are kept: a resumed session (resume.py) sends them first, as a
new controller knows none of them. The new controller may refuse one (a slice of it degraded:
its worker is lost, or its island's group still forming): such a program is `refused`, and its
next call registers it again first (programs.py `execute`), failing with the controller's
reason until that succeeds, rather than running a program the controller does not know.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future as CFuture
from typing import TYPE_CHECKING, Any

from schemas.pathways.v1 import controller_pb2 as cpb

from ..errors import ConnectionFailed, ProgramError

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger(__name__)

# How long a registration waits for its answer, beyond the runtime's reconnect window.
REGISTER_S = 300


class Registrations:
    """A runtime's program registrations: those answered (with their functions) and those not yet."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.known_functions: set[str] = set()  # ids of the functions the server accepted from us
        # what a resumed session sends again: every program registered, registrations unanswered
        self.programs: dict[str, tuple[cpb.ProgramGraph, list[Any]]] = {}
        self.pending: dict[int, CFuture[cpb.ProgramRegistered]] = {}
        self.pending_msgs: dict[int, cpb.ClientMessage] = {}
        self.resent: dict[int, str] = {}  # request id -> program id, of what a resumed session sent again
        self.refused: dict[str, str] = {}  # program id -> why the controller refused it again

    def register(self, graph: cpb.ProgramGraph, functions: list[Any]) -> str:
        """Registers a program graph in one round trip: functions this runtime registered before
        go by id alone, the others with their bytes. Should the server lack some anyway (a
        restarted controller), it names them and a second round trip sends their bytes."""
        known = self.known_functions
        infos = [cpb.FunctionInfo(function_id=f.function_id, name=f.name, donate=list(f.donate),
                                  exported=b"" if f.function_id in known else f.exported)
                 for f in functions]
        reply = self.register_once(graph, infos)
        if reply.missing_functions:
            missing = set(reply.missing_functions)
            infos = [
                cpb.FunctionInfo(function_id=f.function_id, name=f.name, donate=list(f.donate),
                                 exported=f.exported if f.function_id in missing else b"")
                for f in functions
            ]
            reply = self.register_once(graph, infos)
        if reply.error:
            raise ProgramError(reply.error)
        if reply.missing_functions:
            raise ProgramError("the server did not accept the compiled functions")
        known.update(f.function_id for f in functions)
        self.programs[reply.program_id] = (graph, list(functions))
        return reply.program_id

    def register_once(self, graph: cpb.ProgramGraph, infos: list[cpb.FunctionInfo]) -> cpb.ProgramRegistered:
        """One registration's round trip."""
        rt = self.rt
        request_id = rt.new_id()
        fut: CFuture[cpb.ProgramRegistered] = CFuture()
        self.pending[request_id] = fut
        msg = cpb.ClientMessage(register=cpb.RegisterProgram(request_id=request_id, graph=graph, functions=infos))
        self.pending_msgs[request_id] = msg
        rt.send(msg)
        return fut.result(timeout=REGISTER_S + rt.reconnect_s)

    def ensure(self, program_id: str) -> None:
        """Registers `program_id` again if the controller refused it when the session resumed;
        raises ProgramError with the controller's reason while it still refuses it."""
        if program_id not in self.refused:
            return
        graph, functions = self.programs[program_id]
        self.register(graph, functions)  # ProgramError: refused again (the slice still degraded)
        self.refused.pop(program_id, None)

    def answered(self, reply: cpb.ProgramRegistered) -> None:
        """The server's answer to a registration (the runtime's reader)."""
        program_id = self.resent.pop(reply.request_id, None)
        if program_id is not None:  # a program registered again as its session resumed
            if reply.error or reply.missing_functions:
                why = reply.error or "the server did not accept the compiled functions"
                log.warning("program %s not registered again after resuming the session: %s", program_id, why)
                self.refused[program_id] = why
            else:
                self.refused.pop(program_id, None)
            return
        self.pending_msgs.pop(reply.request_id, None)
        fut = self.pending.pop(reply.request_id, None)
        if fut is not None:
            fut.set_result(reply)

    def session_over(self, error: str) -> None:
        """The session ended: registrations still waiting fail with `error`."""
        for fut in list(self.pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionFailed(error))
        self.pending.clear()
        self.pending_msgs.clear()
        self.resent.clear()

    def again(self) -> list[cpb.ClientMessage]:
        """What a resumed session sends first: every program registered before, with its
        functions' bytes (a new controller has none), then the registrations still unanswered."""
        out = []
        self.resent.clear()  # answers to an earlier stream's are not coming
        for program_id, (graph, functions) in list(self.programs.items()):
            infos = [cpb.FunctionInfo(function_id=f.function_id, name=f.name, donate=list(f.donate),
                                      exported=f.exported) for f in functions]
            request_id = self.rt.new_id()
            self.resent[request_id] = program_id
            out.append(cpb.ClientMessage(register=cpb.RegisterProgram(request_id=request_id, graph=graph,
                                                                      functions=infos)))
        out.extend(self.pending_msgs.values())
        return out
