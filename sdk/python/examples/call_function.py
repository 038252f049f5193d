"""Register a Python function once, then invoke it from a script.

python examples/call_function.py              # kubeconfig of `kruntimes up` in .kruntimes/
"""

from __future__ import annotations

import sys

from kruntimes import InvocationError
from kruntimes.kubernetes import from_kube_config

SOURCE = """
def handle(event):
    words = event["text"].split()
    return {"words": len(words), "longest": max(words, key=len) if words else None}
"""


def main() -> int:
    with from_kube_config(sys.argv[1] if len(sys.argv) > 1 else None) as client:
        runtime = client.runtime("default", "python")
        fn = runtime.create_function("word-count", source=SOURCE, handler="main:handle", idle_timeout=300)
        try:
            print(fn.invoke({"text": "the quick brown fox jumps"}))
            try:
                fn.invoke({"no": "text"})
            except InvocationError as e:
                print(f"the handler raised {e.error_type}: {e.error_message}\n{e.traceback}")
        finally:
            fn.delete()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
