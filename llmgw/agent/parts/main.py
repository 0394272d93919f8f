"""Dispatch, serve and main: argv and stdin to one verb, or one JSON line per request."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from llmgw.agent.parts.config import NodeConfig, load_config
from llmgw.agent.parts.engines import verb_start
from llmgw.agent.parts.fetch import verb_fetch, verb_fetch_worker
from llmgw.agent.parts.guard import verb_remove_weights
from llmgw.agent.parts.inventory import verb_hello, verb_inventory
from llmgw.agent.parts.lease import verb_lease
from llmgw.agent.parts.peer import verb_peer_server, verb_seed
from llmgw.agent.parts.protocol import (
    CHUNK,
    DEFAULT_CONFIG,
    INTERNAL_VERBS,
    PUBLIC_VERBS,
    SERVE_MAX_LINE,
    SERVE_WORKERS,
    USAGE,
    AgentError,
    JsonDict,
    Refused,
    UsageError,
)
from llmgw.agent.parts.spawn import verb_engine_monitor
from llmgw.agent.parts.status import verb_status
from llmgw.agent.parts.stopping import verb_stop

# ----------------------------------------------------------------------------------------------
# Dispatch, serve, main


HANDLERS: Dict[str, Callable[[NodeConfig, JsonDict], JsonDict]] = {
    "hello": verb_hello,
    "inventory": verb_inventory,
    "lease": verb_lease,
    "fetch": verb_fetch,
    "seed": verb_seed,
    "start": verb_start,
    "stop": verb_stop,
    "status": verb_status,
    "remove-weights": verb_remove_weights,
    "_fetch-worker": verb_fetch_worker,
    "_engine-monitor": verb_engine_monitor,
    "_peer-server": verb_peer_server,
}


def run_verb(verb: str, config_path: str, request: JsonDict) -> JsonDict:
    # The config is read for every request, so `serve` picks up an operator's edit at once.
    return HANDLERS[verb](load_config(config_path), request)


def parse_argv(args: List[str]) -> Tuple[Optional[str], Optional[str]]:
    """(--config value, verb) from the command line."""
    config, verb, index = None, None, 0
    while index < len(args):
        arg = args[index]
        if arg == "--config" and index + 1 < len(args):
            config, index = args[index + 1], index + 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg.startswith("-") or verb is not None:
            raise UsageError(f"unexpected argument {arg!r}; {USAGE}")
        else:
            verb = arg
        index += 1
    return config, verb


def select_verb(argv_verb: Optional[str], environ: Dict[str, str]) -> str:
    if argv_verb is not None:
        if argv_verb in PUBLIC_VERBS or argv_verb in INTERNAL_VERBS:
            return argv_verb
        raise UsageError(f"unknown verb {argv_verb!r}; {USAGE}")
    original = environ.get("SSH_ORIGINAL_COMMAND")
    if original is None:
        raise UsageError(f"no verb given; {USAGE}")
    # Locked node: authorized_keys pins this program and the client's command only picks the
    # verb. Only its last word counts, and only a public verb; nothing else the client typed
    # ever becomes a path, the config or an argument.
    words = original.split()
    if not words or words[-1] not in PUBLIC_VERBS:
        raise UsageError(f"SSH_ORIGINAL_COMMAND must end with a verb; {USAGE}")
    return words[-1]


def parse_request(data: bytes) -> JsonDict:
    """The JSON object on stdin; empty input counts as {} so `hello </dev/null` works by hand."""
    try:
        text = data.decode("utf-8")
        request = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise AgentError(f"request is not valid JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise AgentError("request must be a JSON object")
    return request


def serve(config_path: str, stdin: Any, stdout: Any) -> int:
    """One JSON request per line in, one JSON answer per line out, until EOF.

    Requests run concurrently (up to SERVE_WORKERS): a `stop` waiting out its grace period must
    not hold up the node's other calls. Answers carry their request's id and come in the order
    they finish. At EOF the calls still running are finished and answered before exiting."""
    out_lock = threading.Lock()
    slots = threading.BoundedSemaphore(SERVE_WORKERS)
    running: List[threading.Thread] = []

    def answer(line: bytes) -> None:
        try:
            data = json.dumps(serve_line(config_path, line)).encode("utf-8") + b"\n"
            with out_lock:
                stdout.write(data)
                stdout.flush()
        except BrokenPipeError:
            pass  # the dispatcher went away; nobody is left to answer
        finally:
            slots.release()

    def refuse(message: JsonDict) -> None:
        with out_lock, contextlib.suppress(BrokenPipeError):
            stdout.write(json.dumps(message).encode("utf-8") + b"\n")
            stdout.flush()

    while True:
        line = stdin.readline(SERVE_MAX_LINE + 1)
        if not line:
            break
        if len(line) > SERVE_MAX_LINE:
            _skip_rest_of_line(stdin, line)
            refuse({"id": None, "error": f"bad request line: longer than {SERVE_MAX_LINE} bytes"})
            continue
        if not line.strip():
            continue  # blank lines (keep-alives) get no answer
        slots.acquire()
        worker = threading.Thread(target=answer, args=(line,), name="llmgw-serve")
        worker.start()
        running = [t for t in running if t.is_alive()] + [worker]
    for worker in running:
        worker.join()
    return 0


def _skip_rest_of_line(stdin: Any, start: bytes) -> None:
    """Read and drop the rest of an overlong line, a bounded piece at a time."""
    chunk = start
    while chunk and not chunk.endswith(b"\n"):
        chunk = stdin.readline(CHUNK)


SERVE_VERBS = tuple(v for v in PUBLIC_VERBS if v != "serve")


def serve_line(config_path: str, line: bytes) -> JsonDict:
    try:
        message = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        return {"id": None, "error": f"bad request line: {exc}"}
    if not isinstance(message, dict):
        return {"id": None, "error": "a request line must be a JSON object {id, verb, request}"}
    request_id, verb, request = message.get("id"), message.get("verb"), message.get("request", {})
    if verb not in SERVE_VERBS:
        return {"id": request_id, "error": f"unknown verb {verb!r}; serve answers {', '.join(SERVE_VERBS)}"}
    if not isinstance(request, dict):
        return {"id": request_id, "error": "request must be a JSON object"}
    try:
        return {"id": request_id, "answer": run_verb(verb, config_path, request)}
    except AgentError as exc:
        return dict(error_answer(exc), id=request_id)
    except Exception as exc:  # noqa: BLE001 - a bug in one verb must not end the channel every call shares
        traceback.print_exc(file=sys.stderr)
        return {"id": request_id, "error": f"internal error in {verb}: {exc!r}"}


def error_answer(exc: AgentError) -> JsonDict:
    """The error object of the protocol; a refusal also names the node setting that decides it."""
    answer: JsonDict = {"error": str(exc)}
    if isinstance(exc, Refused):
        answer["refused"] = {"setting": exc.setting}
    return answer


def _emit(answer: JsonDict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    try:
        config_flag, argv_verb = parse_argv(sys.argv[1:] if argv is None else argv)
        verb = select_verb(argv_verb, dict(os.environ))
        config_path = config_flag or os.environ.get("LLMGW_AGENT_CONFIG") or DEFAULT_CONFIG
        if verb == "serve":
            return serve(config_path, sys.stdin.buffer, sys.stdout.buffer)
        answer = run_verb(verb, config_path, parse_request(sys.stdin.buffer.read()))
    except AgentError as exc:
        _emit(error_answer(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - the caller still gets a JSON answer; the traceback goes to stderr
        traceback.print_exc(file=sys.stderr)
        _emit({"error": f"internal error: {exc!r}"})
        return 1
    _emit(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
