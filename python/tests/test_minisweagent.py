"""mini-swe-agent's DefaultAgent with its DeterministicModel in a taskbox sandbox: list the
repository, run the failing test, edit the bug, run the passing test, submit."""

from __future__ import annotations

from pathlib import Path

from conftest import Supervisor, make_workspace, require

try:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output
except ImportError as exc:
    DefaultAgent = None  # type: ignore[assignment,misc]
    IMPORT_ERROR = str(exc)
else:
    IMPORT_ERROR = ""

SYSTEM = "You fix bugs. Reply with one shell command in a ```mswea_bash_command block."
INSTANCE = "{{task}}"


def test_a_deterministic_agent_fixes_a_bug_in_a_sandbox(supervisor: Supervisor, tmp_path: Path) -> None:
    require(DefaultAgent is not None, f"mini-swe-agent is not installed (pip install mini-swe-agent): {IMPORT_ERROR}")
    ws = make_workspace(tmp_path / "repo")
    check = "python3 -c 'import sys; sys.path.insert(0, \"src\"); import calc; assert calc.add(2, 3) == 5, calc.add(2, 3)'"
    outputs = [
        make_output("look around", [{"command": "ls; ls src tests"}]),
        make_output("run the test", [{"command": check}]),
        make_output("fix it", [{"command": "sed -i 's/a - b/a + b/' src/calc.py && cat src/calc.py"}]),
        make_output("run it again", [{"command": check + " && echo PASSED"}]),
        make_output("done", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo fixed add"}]),
    ]
    env = get_environment(
        {"environment_class": "taskbox.minisweagent.TaskboxEnvironment", "workspace": str(ws),
         "socket": str(supervisor.socket), "timeout": 60,
         # Bytecode would show in the diff (changes leave out nothing yet).
         "env": {"PYTHONDONTWRITEBYTECODE": "1"}},
    )
    try:
        agent = DefaultAgent(DeterministicModel(outputs=outputs), env, system_template=SYSTEM,
                             instance_template=INSTANCE, step_limit=10, cost_limit=100)
        result = agent.run("make add() add")
        assert result["exit_status"] == "Submitted" and result["submission"].strip() == "fixed add"
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "README.md" in observations[0] and "calc.py" in observations[0] and "test_calc.py" in observations[0]
        # The failing check: its traceback (stderr) is in the output, merged, with exit 1.
        assert "<returncode>1</returncode>" in observations[1] and "AssertionError: -1" in observations[1]
        assert "return a + b" in observations[2]
        assert "<returncode>0</returncode>" in observations[3] and "PASSED" in observations[3]
        # The change is in the sandbox's diff; the repository on the host is untouched.
        diff = env.sandbox.diff()
        assert [f.path for f in diff.files] == ["src/calc.py"] and "+    return a + b" in diff.diff
        assert (ws / "src/calc.py").read_text().endswith("a - b\n")
    finally:
        sid = env.sandbox.id if env.sandbox else None
        env.cleanup()
    with supervisor.client() as c:
        assert all(s.id != sid for s in c.sandboxes())


def test_merged_output_keeps_its_order_and_timeouts_are_reported(supervisor: Supervisor, tmp_path: Path) -> None:
    require(DefaultAgent is not None, f"mini-swe-agent is not installed: {IMPORT_ERROR}")
    from taskbox.minisweagent import TaskboxEnvironment

    env = TaskboxEnvironment(workspace=str(make_workspace(tmp_path / "repo")), socket=str(supervisor.socket))
    try:
        out = env.execute({"command": "echo 1; echo 2 >&2; echo 3; exit 4"})
        assert (out["output"], out["returncode"]) == ("1\n2\n3\n", 4)
        assert env.execute({"command": "pwd"}, cwd="src")["output"].strip().endswith("/repo/src")
        slow = env.execute({"command": "echo started; sleep 10"}, timeout=1)
        assert slow["returncode"] == -1 and "timed out" in slow["exception_info"] and slow["output"] == "started\n"
        assert env.get_template_vars()["sandbox"]["id"] == env.sandbox.id  # type: ignore[union-attr]
    finally:
        env.cleanup()
        env.cleanup()
