"""The machines view (claim / write / exec / release) against the real ``kruntimes up``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import kruntimes
from kruntimes.machines import PROJECT_LABEL, ExecRequest, Machines, Spec

from .conftest import Server


def test_exec_machines_run_argv_with_the_shells_exit_codes(client: kruntimes.Client, server: Server) -> None:
    machines = Machines(client, "bash")
    spec = Spec(org="default", cls="exec", project="py-proj", ttl_sec=600)
    # Four claims of one project at once: all Ready together, each its own machine.
    with ThreadPoolExecutor(4) as pool:
        leases = list(pool.map(lambda _: machines.claim(spec), range(4)))
    assert len({lease.id for lease in leases}) == 4
    try:
        for i, lease in enumerate(leases):
            machines.write(lease, "in/deep/n.txt", f"machine {i}")
        for i, lease in enumerate(leases):
            seen = machines.exec(lease, ExecRequest(argv=["cat", "in/deep/n.txt"]))
            assert (seen.exit_code, seen.stdout) == (0, f"machine {i}".encode())
        lease = leases[0]
        assert machines.exec(lease, ExecRequest(argv=["echo", "; rm -rf /"])).stdout == b"; rm -rf /\n"
        three = machines.exec(lease, ExecRequest(argv=["sh", "-c", "echo $G >&2; exit 3"], env={"G": "hi"}))
        assert (three.exit_code, three.stderr) == (3, b"hi\n")
        assert machines.exec(lease, ExecRequest(argv=["sh", "-c", "kill -9 $$"])).exit_code == 137
        missing = machines.exec(lease, ExecRequest(argv=["no-such-program"]))
        assert missing.exit_code == 127 and b"no-such-program" in missing.stderr
        slow = machines.exec(lease, ExecRequest(argv=["sleep", "60"], timeout_sec=1))
        assert slow.timed_out and slow.exit_code == 124
        with pytest.raises(kruntimes.InvalidRequest):
            machines.exec(lease, ExecRequest(argv=[]))
        with pytest.raises(kruntimes.InvalidRequest):
            machines.claim(Spec(org="default", cls="desktop", project="py-proj"))
        with pytest.raises(kruntimes.InvalidRequest):
            machines.claim(Spec(org="default", cls="dev", project="Not_A_Name"))
        with pytest.raises(kruntimes.InvalidRequest):
            machines.claim(Spec(org="default", cls="exec", project="not a label"))
    finally:
        for lease in leases:
            machines.release(lease)
    # Released: asked to end and deleted, not waited for; each Run goes after its cleanup.
    for lease in leases:
        server.kubectl("wait", "--for=delete", f"run/{lease.id}", "-n", "default", "--timeout=60s")
    left = server.kubectl("get", "runs", "-n", "default", "-l", f"{PROJECT_LABEL}=py-proj", "-o", "name")
    assert left.strip() == ""


def test_dev_machines_hold_their_project_and_keep_its_files(client: kruntimes.Client, server: Server) -> None:
    machines = Machines(client, "bash")
    spec = Spec(org="default", cls="dev", project="py-dev")
    first = machines.claim(spec)
    assert first.id == "py-dev"
    machines.write(first, "kept/file.txt", "kept")
    # Held while it exists: 409 from the API server; another project is not held up.
    with pytest.raises(kruntimes.Conflict):
        machines.claim(spec)
    other = machines.claim(Spec(org="default", cls="dev", project="py-dev-other"))
    machines.release(first)
    # The release returned once the files were committed: the next claim has them.
    second = machines.claim(spec)
    try:
        seen = machines.exec(second, ExecRequest(argv=["cat", "kept/file.txt"]))
        assert (seen.exit_code, seen.stdout) == (0, b"kept")
        commits = server.kubectl("get", "workspace", "py-dev", "-n", "default", "-o", "jsonpath={.status.commits}")
        assert commits.strip() == "1"
    finally:
        machines.release(second)
        machines.release(other)
