"""Studies shared across hosts on a real PostgreSQL server (tests/postgres.py): workers
that start together, see each other's trials, never measure a config twice, and leave one
profile between them; a worker killed mid-trial leaves its trial to the other."""

import subprocess
import sys
import textwrap
from pathlib import Path

import optuna

from conftest import REPO, run_main, tiny_gpt_dict, write_spec
from postgres import postgres_server, postgres_url, wait_until  # noqa: F401  (fixtures)

_OPEN_TOGETHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from autofit.search.study import make_study

    folder = Path(sys.argv[2])
    (folder / f"ready-{sys.argv[3]}").touch()
    while not (folder / "go").exists():  # every worker opens the storage at the same moment
        time.sleep(0.005)
    make_study(study_name="race", storage=sys.argv[1])
""")


def start_together(script: str, args: list[list[str]], folder: Path) -> list[tuple[int, str]]:
    """Run `python -c script ARGS FOLDER I` for each ARGS; each waits (after its imports)
    until all are ready. Returns each one's (exit code, stderr)."""
    workers = [subprocess.Popen([sys.executable, "-c", script, *a, str(folder), str(i)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for i, a in enumerate(args)]
    wait_until(lambda: len(list(folder.glob("ready-*"))) == len(args) or any(w.poll() is not None for w in workers),
               120, "the workers' imports")
    (folder / "go").touch()
    results = []
    for w in workers:
        _, err = w.communicate(timeout=120)
        results.append((w.returncode, err))
    return results


def test_workers_opening_an_empty_database_at_once_all_get_the_study(postgres_url, tmp_path):
    """Optuna creates its tables on first use; several workers doing it at the same moment
    collide in PostgreSQL's catalog (UniqueViolation on pg_type_typname_nsp_index)."""
    results = start_together(_OPEN_TOGETHER, [[postgres_url]] * 3, tmp_path)
    assert [rc for rc, _ in results] == [0] * 3, "\n".join(err[-1500:] for _, err in results)
    assert optuna.get_all_study_names(postgres_url) == ["race"]


def test_a_missing_database_driver_names_the_pip_install_that_fixes_it(tmp_path, capsys, monkeypatch):
    spec = write_spec(tmp_path, tiny_gpt_dict())
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as on a machine without the extra
    for url, fix in [("postgresql://u:secret@db.example/autofit", "pip install 'autofit[postgres]'"),
                     ("postgresql+psycopg2://u:secret@db.example/autofit", "pip install psycopg2-binary")]:
        code, out, err = run_main(capsys, "tune", spec, "--device", "cpu", "--storage", url, "--out", tmp_path)
        assert code == 2 and err.count("\n") == 1, err
        assert fix in err and "secret" not in err
