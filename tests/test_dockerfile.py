"""The image installs what `make install` installs: the same pip installs in the same order (torch pinned first, from
the CPU index for the CPU image), on the Ray and Python that the venv has, runs `make serve`'s command as a non-root
user, and carries the demo checkpoint. No container runtime builds images here, so the files are compared."""

from __future__ import annotations

import fnmatch
import re
import shlex
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# pip options that change how pip talks, not what it installs.
QUIET = {"--quiet", "--disable-pip-version-check", "--no-cache-dir", "$@"}
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def install_recipe() -> list[str]:
    """The shell lines of the Makefile rule that `make install` runs."""
    return re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1].splitlines()


def pip_installs(lines: list[str]) -> list[list[str]]:
    """What each `pip install` in these shell lines installs, in order."""
    installs = []
    for line in lines:
        for command in re.split(r"&&|;|\|\|", line):
            argv = shlex.split(command)
            at = next((i for i in range(len(argv) - 1) if argv[i : i + 2] == ["pip", "install"]), None)
            if at is not None:
                installs.append([a for a in argv[at + 2 :] if a not in QUIET])
    return installs


def runs() -> list[str]:
    return [args for op, args in dockerfile() if op == "RUN"]


def test_the_image_runs_the_pip_installs_of_make_install():
    make = pip_installs(install_recipe())
    assert make[0] == ["torch==2.13.0"] and len(make) == 2, make  # the parse found make install's two steps
    assert pip_installs(runs()) == make


def test_the_cpu_image_takes_torch_from_the_cpu_index():
    (torch_run,) = [run for run in runs() if "torch==" in run]
    assert re.search(rf'\[ "\$DEVICE" = cpu \]; then set -- --index-url {CPU_INDEX}; fi', torch_run), torch_run
    assert '"$@" torch==' in torch_run  # the index reaches that pip install


def test_the_base_image_has_the_pinned_ray_and_the_venvs_python():
    ray = re.search(r"^ray\[serve\]==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)[1]
    (base,) = [args for op, args in dockerfile() if op == "FROM"]
    assert base == f"rayproject/ray:{ray}-py{sys.version_info.major}{sys.version_info.minor}-${{DEVICE}}"


def test_the_image_serves_as_make_serve_does_as_a_non_root_user():
    make_serve = re.search(r"^serve:.*\n\t.*\$\(VENV\)/bin/(serve run .*)$", (ROOT / "Makefile").read_text(), re.M)[1]
    (cmd,) = [args for op, args in dockerfile() if op == "CMD"]
    assert " ".join(yaml.safe_load(cmd)) == make_serve
    users = [args for op, args in dockerfile() if op == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_the_image_carries_the_files_it_installs_and_serves():
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()[:1] not in ("", "#")]
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    model = config["applications"][0]["args"]["model"]
    needed = [model, "serve_config.yaml", "requirements.txt", "requirements-test.txt", "deployments/app.py"]
    for path in needed:
        parts = Path(path).parts
        assert not any(fnmatch.fnmatch("/".join(parts[:n]), p) for p in ignored for n in range(1, len(parts) + 1)), path
    assert (ROOT / model / "config.json").exists()
