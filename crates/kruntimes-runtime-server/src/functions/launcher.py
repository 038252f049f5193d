# The python adapter's launcher for function registrations (see python.rs beside it).
#
# Run by the runtime server as `python3 -u -B -I -c <this file> HANDLER RUN_UID ATTEMPT`
# with the registration's work directory as cwd, or as the server's warm spare
# (`... -c <this file> --spare`, see spare.rs), which learns all of that from its first
# request frame instead. It imports the handler once, then answers
# invocations until end-of-file on its request pipe. The server and this script talk over
# two pipes, never over stdin/stdout (the handler may print): requests arrive on fd 3,
# responses leave on fd 4. Every frame is a 4-byte big-endian length and that many bytes of
# UTF-8 JSON:
#
#   spare only, once started:  {"spare": true}
#   spare only, then the server sends:
#                    {"handler": ..., "run_uid": ..., "attempt": N, "cwd": WORK,
#                     "env": [[NAME, VALUE], ...], "stdout": LOG, "stderr": LOG}
#                and the spare answers {"bound": true} once it has taken that place,
#                before any of the handler's code runs, or {"unbound": true,
#                "message": ...} and exits if it cannot
#   after loading:   {"ready": true}
#                or  {"ok": false, "type": ..., "message": ..., "traceback": ...}, then exit
#   request:         {"id": INVOCATION_ID, "payload": "<the request's JSON text>"}
#   response:        {"ok": true, "result": "<the result's JSON text>"}
#                or  {"ok": false, "type": ..., "message": ..., "traceback": ...}
#
# The server bounds every field again; the limits here only keep frames small.
# Only what every registration needs is imported up front: `inspect` (with ast and
# tokenize) alone costs about 27 ms and `traceback` a few more, both paid before the
# function is Ready. They are imported when needed: `traceback` on the first failure,
# `inspect` for a callable without a code object.
import importlib
import json
import os
import struct
import sys
import types

REQUESTS = 3
RESPONSES = 4
MAX_MESSAGE_CHARS = 4096
MAX_TRACEBACK_CHARS = 16384
MAX_RESULT_BYTES = 1024 * 1024
HEADER = struct.Struct(">I")
# Code compiled from `-c` has this file name; those frames are the launcher's own.
LAUNCHER_FILE = "<string>"


def read_exact(n):
    data = os.read(REQUESTS, n)
    if len(data) == n:
        return data
    if not data:
        return None
    buf = bytearray(data)
    while len(buf) < n:
        chunk = os.read(REQUESTS, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame():
    header = read_exact(HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    body = read_exact(length) if length else b""
    if body is None:
        return None
    return json.loads(body)


def write_frame(obj):
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:
        written = os.write(RESPONSES, data)
        data = data[written:]


def clean(text):
    # A lone surrogate cannot be encoded as UTF-8; replace it rather than fail the frame.
    return text.encode("utf-8", "replace").decode("utf-8")


def describe(exc):
    try:
        return str(exc)
    except BaseException:
        return "<the exception's message cannot be shown>"


def failure(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == LAUNCHER_FILE:
        tb = tb.tb_next
    try:
        import traceback

        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except BaseException:
        text = ""
    return {
        "ok": False,
        "type": clean(type(exc).__name__),
        "message": clean(describe(exc)[:MAX_MESSAGE_CHARS]),
        "traceback": clean(text[-MAX_TRACEBACK_CHARS:]),
    }


CO_VARARGS = 0x04


def arity(handler, fn):
    """1 for fn(event), 2 for fn(event, context)."""
    function = fn.__func__ if isinstance(fn, types.MethodType) else fn
    code = getattr(function, "__code__", None)
    if code is None:
        return arity_by_signature(handler, fn)
    bound = 1 if function is not fn else 0
    positional = code.co_argcount - bound
    defaults = len(getattr(function, "__defaults__", None) or ())
    required = positional - min(defaults, positional)
    keyword_required = code.co_kwonlyargcount - len(getattr(function, "__kwdefaults__", None) or {})
    variadic = bool(code.co_flags & CO_VARARGS)
    return decide(handler, positional, required, keyword_required > 0, variadic)


def arity_by_signature(handler, fn):
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return 1
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    keyword_required = any(p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in params)
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    return decide(handler, len(positional), len(required), keyword_required, variadic)


def decide(handler, positional, required, keyword_required, variadic):
    if required > 2 or keyword_required:
        raise TypeError(
            f"handler {handler} needs more than (event, context); it is called as "
            "fn(event) or fn(event, context)"
        )
    if positional >= 2 or variadic:
        return 2
    if positional == 1:
        return 1
    raise TypeError(
        f"handler {handler} takes no positional parameter; it is called as "
        "fn(event) or fn(event, context)"
    )


def load(handler):
    if ":" in handler:
        module_name, attribute = handler.split(":", 1)
    else:
        module_name, _, attribute = handler.rpartition(".")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"handler {handler} is not callable (it is a {type(target).__name__})")
    return target, arity(handler, target)


def invoke(fn, takes_context, request, run_uid, attempt):
    try:
        event = json.loads(request["payload"])
        if takes_context:
            context = {"invocation_id": request["id"], "run_uid": run_uid, "attempt": attempt}
            result = fn(event, context)
        else:
            result = fn(event)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt fail the call only
        return failure(exc)
    try:
        text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        size = len(text.encode("utf-8"))
    except BaseException as exc:
        return {
            "ok": False,
            "type": "ResultNotJson",
            "message": clean(
                f"the result cannot be encoded as JSON: {type(exc).__name__}: "
                f"{describe(exc)}"[:MAX_MESSAGE_CHARS]
            ),
            "traceback": "",
        }
    if size > MAX_RESULT_BYTES:
        return {
            "ok": False,
            "type": "ResultTooLarge",
            "message": f"the result is {size} bytes of JSON, more than {MAX_RESULT_BYTES}",
            "traceback": "",
        }
    return {"ok": True, "result": text}


def bind():
    """The spare's wait: once the server sends a registration, become what a launcher
    started for it would be (cwd, environment, stdout and stderr on its log files)."""
    write_frame({"spare": True})
    try:
        frame = read_frame()
        if frame is None:
            os._exit(0)
        os.chdir(frame["cwd"])
        os.environ.clear()
        os.environ.update((name, value) for name, value in frame["env"])
        for target, path in ((1, frame["stdout"]), (2, frame["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            os.dup2(fd, target)
            os.close(fd)
        bound = frame["handler"], frame["run_uid"], int(frame["attempt"])
    except BaseException as exc:
        message = f"{type(exc).__name__}: {describe(exc)}"
        write_frame({"unbound": True, "message": clean(message[:MAX_MESSAGE_CHARS])})
        os._exit(1)
    write_frame({"bound": True})
    return bound


def main():
    # The pipes are the launcher's: programs the handler starts do not inherit them.
    os.set_inheritable(REQUESTS, False)
    os.set_inheritable(RESPONSES, False)
    if sys.argv[1:] == ["--spare"]:
        handler, run_uid, attempt = bind()
    else:
        handler, run_uid, attempt = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.argv = [handler]
    # -I leaves the working directory (the sources) off sys.path; PYTHONPATH is honoured
    # after it, as a plain `python3` would.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:0] = [os.getcwd()] + extra
    try:
        fn, count = load(handler)
    except BaseException as exc:
        write_frame(failure(exc))
        os._exit(1)
    write_frame({"ready": True})
    takes_context = count == 2
    while True:
        request = read_frame()
        if request is None:
            os._exit(0)
        write_frame(invoke(fn, takes_context, request, run_uid, attempt))


main()
