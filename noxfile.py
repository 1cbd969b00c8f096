"""Nox sessions of the Colossal monorepo: per-package tests, integration, lint, layering.

``python3 -m nox`` runs every session; ``python3 -m nox -l`` lists them. Sessions:

* ``lint``: ``ruff check`` over the repository (pinned ruff).
* ``layering``: ``tools/check_layering.py`` on the repository, ``tools/count_any.py`` holding
  the line on ``Any`` in public signatures (``MAX_PUBLIC_ANY``), and the tools' own tests.
* ``tests(package='<dist>')``: one per ``packages/<dist>/pyproject.toml``. Fresh virtualenv,
  ``torch==2.13.0`` first, then wheels of the package and of the sibling ``colossal*``
  distributions it needs (built from this checkout, installed by path, never fetched from an
  index), its ``test`` extra and pytest; checks the installed import, then runs
  ``packages/<dist>/tests`` from outside the source tree so the installed wheel is tested.
* ``integration``: every package's wheel installed together, pytest on ``integration-tests/``.
* ``typecheck``: mypy (pinned) over every ``packages/*/src`` in one run, configured by the root
  pyproject.toml ``[tool.mypy]``; sibling imports resolve to this checkout's source through
  ``mypy_path``, third-party imports to the packages' runtime dependencies installed in the venv.
* ``newest_transformers``: like ``tests``, but with the newest ``transformers<6`` the index
  serves instead of the ``constraints.txt`` pin (the README's first command installs the
  newest release, CI pins one): colossal-shardformer's tests of every policy and the
  meta-package's hybrid tests (``NEWEST_TRANSFORMERS_TESTS``), so a release that breaks a
  policy fails CI.

Extra arguments after ``--`` go to pytest, e.g.
``python3 -m nox -s "tests(package='colossal-core')" -- -x -k mesh``.
JUnit XML results go to ``.ci-results/`` (``layering.xml``, ``tests-<dist>.xml``,
``integration.xml``, ``typecheck.xml``); ``tools/summarize_junit.py`` sums them.
"""

from __future__ import annotations

import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself depends on tomli before Python 3.11
    import tomli as tomllib

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "virtualenv"  # nox's default; pip installs, no uv
nox.options.reuse_existing_virtualenvs = False  # every run starts from fresh virtualenvs
nox.options.error_on_external_run = True

REPO = Path(__file__).resolve().parent
PACKAGES_DIR = REPO / "packages"
RESULTS_DIR = REPO / ".ci-results"
CONSTRAINTS = REPO / "constraints.txt"
DEV_REQUIREMENTS = REPO / "requirements-dev.txt"  # plain pins, also used as a constraints file
INTEGRATION_DIR = REPO / "integration-tests"
TORCH = "torch==2.13.0"  # also pinned in constraints.txt; always installed first, explicitly

# Distribution name -> the import it is checked by. Default: "colossal-x-y" -> "colossal.x_y".
IMPORT_NAMES = {"colossal": "colossal.booster", "colossalai-compat": "colossalai"}
# Distributions of this repository outside the `colossal-*` naming: opt-in, never a dependency
# of another package here (colossalai-compat ships the top-level `colossalai`, DESIGN.md).
OPT_IN = frozenset({"colossalai-compat"})
# Modules that importing a distribution's packages must not pull in (DESIGN.md: plugins load
# their heavy dependencies only when used).
MUST_STAY_UNIMPORTED = {
    "colossal": ("colossal.gemini", "colossal.shardformer", "transformers"),
    "colossal-integrations": ("transformers", "accelerate", "lightning"),
}
# The newest_transformers session: transformers unpinned below its next major, and the tests
# that run Hugging Face models through the shardformer policies. Entries are file globs or
# "file::test" node ids under packages/<dist>/tests. The shardformer part is a subset that
# still covers every policy (the full directory took ~3 of the session's ~7 minutes, over CI's
# budget): each hand-written policy (GPT-2, BERT, ViT, OPT, Bloom) sharded at TP 4, the
# base_model_tp_plan policy on its families, every family's pipeline stages (in one process
# and at PP 4), sequence parallelism on every family, attention through transformers'
# AttentionInterface, config and policy validation, gradient checkpointing of the 5.x layers.
# The meta-package adds one hybrid plugin run (TP x PP and PP x DP), its checkpoint read by
# every plugin, and the tensor-parallel state dicts (from_pretrained): the plugin's other
# tests exercise the same policies as the shardformer subset (the whole set took ~4 minutes).
UNPINNED = "transformers"
NEWEST_TRANSFORMERS = "transformers>=5,<6"
NEWEST_TRANSFORMERS_TESTS: dict[str, tuple[str, ...]] = {
    "colossal-shardformer": (
        "test_policy_families.py::test_all_families_tp4",
        "test_tp_plan_models.py",
        "test_pp_plan.py",
        "test_pp_models.py::test_pp4_every_family_1f1b",
        "test_sp_split_gather.py",
        "test_framework_attention.py",
        "test_framework_config.py",
        "test_policy_checks.py",
        "test_grad_ckpt.py",
    ),
    "colossal": (
        "test_hybrid_parallel.py::test_tp2_pp2_and_pp2_dp2",
        "test_hybrid_checkpoint.py::test_tp2_pp2_saves_what_every_plugin_loads",
        "test_state_tp_checkpoint.py",
    ),
}
# tools/count_any.py: the most `Any` the public signatures of all packages may hold (the
# layering session fails above it). Lower it whenever a change removes some; never raise it.
# 193 = 36 in colossal-{core,kernels,zero,pipeline,gemini,shardformer,cli} (issue 30, from 209)
# + 36 in the meta-package + 121 in colossal-legacy, as counted when the check was added.
MAX_PUBLIC_ANY = 98
# Modules the distributed tests' fork server preloads (those not installed are skipped): the
# packages and plugins, and the Hugging Face families the tests build.
TEST_PRELOAD = (
    *(f"colossal.{p}" for p in ("zero", "pipeline", "gemini", "shardformer", "kernels", "legacy")),
    *(f"colossal.booster.plugin.{p}.plugin" for p in ("ddp", "zero", "fsdp", "gemini", "hybrid",
                                                      "moe_hybrid")),
    "transformers",
    *(f"transformers.models.{m}.modeling_{m}" for m in (
        "gpt2", "llama", "bert", "vit", "opt", "bloom", "mixtral", "deepseek_v3", "qwen2",
        "qwen3", "qwen3_moe", "mistral")),
    "peft",
    # colossal-integrations: the trainers (transformers.trainer, accelerate, lightning: seconds
    # each to import in every rank); only its session installs them, elsewhere they are skipped
    "colossal.integrations.hf_trainer", "colossal.integrations.lightning_strategy",
)  # fmt: skip
# Pytest exit code when it collected no tests.
PYTEST_NO_TESTS = 5


@dataclass(frozen=True)
class Package:
    """What the sessions need from one ``packages/<dist>/pyproject.toml``."""

    dist: str  # canonical distribution name == its directory name under packages/
    path: Path
    dependencies: tuple[Requirement, ...] = ()
    test_requirements: tuple[Requirement, ...] = ()
    build_requires: tuple[str, ...] = ()
    problem: str | None = None  # why the pyproject cannot be used (reported by its sessions)

    @property
    def siblings(self) -> tuple[str, ...]:
        """Canonical names of the sibling distributions it depends on (directly)."""
        return tuple(_sibling_names(self.dependencies))

    @property
    def import_names(self) -> tuple[str, ...]:
        """Modules to import to check the installed wheel (each shipped subpackage)."""
        names = {IMPORT_NAMES.get(self.dist, _default_import_name(self.dist))}
        namespace = self.path / "src" / "colossal"
        if namespace.is_dir():
            names.update(
                f"colossal.{d.name}"
                for d in namespace.iterdir()
                if d.is_dir() and (d / "__init__.py").is_file()
            )
        return tuple(sorted(names))


def _default_import_name(dist: str) -> str:
    return "colossal." + dist.removeprefix("colossal-").replace("-", "_")


def _is_sibling(req: Requirement) -> bool:
    """A requirement on a distribution of this repository (``colossal``, ``colossal-*``, opt-in)."""
    name = canonicalize_name(req.name)
    return name == "colossal" or name.startswith("colossal-") or name in OPT_IN


def _sibling_names(reqs: tuple[Requirement, ...]) -> list[str]:
    return [canonicalize_name(r.name) for r in reqs if _is_sibling(r)]


def _load_package(pyproject: Path) -> Package:
    """Read one pyproject; problems are recorded, not raised, so other sessions still run."""
    directory = pyproject.parent
    where = pyproject.relative_to(REPO)
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        project = data.get("project", {})
        name = project.get("name")
        if not name or canonicalize_name(name) != directory.name:
            return Package(
                directory.name,
                directory,
                problem=f"{where}: project.name {name!r} must be the directory name "
                f"{directory.name!r}",
            )
        if "dependencies" in project.get("dynamic", []):
            return Package(
                directory.name,
                directory,
                problem=f"{where}: dynamic dependencies are not supported; list them in "
                "project.dependencies",
            )
        extras = project.get("optional-dependencies", {})
        return Package(
            dist=directory.name,
            path=directory,
            dependencies=tuple(Requirement(r) for r in project.get("dependencies", [])),
            test_requirements=tuple(Requirement(r) for r in extras.get("test", [])),
            build_requires=tuple(data.get("build-system", {}).get("requires", ["hatchling"])),
        )
    except (OSError, ValueError) as exc:  # TOMLDecodeError and InvalidRequirement included
        return Package(directory.name, directory, problem=f"{where}: {exc}")


@cache
def discover_packages() -> dict[str, Package]:
    """Every ``packages/*/pyproject.toml``, by distribution (= directory) name."""
    found = (_load_package(p) for p in sorted(PACKAGES_DIR.glob("*/pyproject.toml")))
    return {pkg.dist: pkg for pkg in found}


def sibling_closure(session: nox.Session, roots: list[str]) -> list[str]:
    """The given distributions plus every sibling they need, transitively, in stable order."""
    packages = discover_packages()
    order: list[str] = []
    pending = list(roots)
    while pending:
        dist = pending.pop(0)
        if dist in order:
            continue
        if dist not in packages:
            needed_by = [p.dist for p in packages.values() if dist in p.siblings]
            session.error(
                f"{dist!r} (needed by {', '.join(needed_by) or 'this session'}) is a colossal "
                f"package, but there is no {PACKAGES_DIR.relative_to(REPO)}/{dist}/pyproject.toml"
            )
        problem = packages[dist].problem
        if problem is not None:
            session.error(problem)
        if dist in OPT_IN and dist not in roots:
            needed_by = [p.dist for p in packages.values() if dist in p.siblings]
            session.error(f"{dist} is opt-in: {', '.join(needed_by)} must not depend on it")
        order.append(dist)
        pending.extend(packages[dist].siblings)
    return order


def _work_dir(session: nox.Session, name: str) -> Path:
    """An empty directory inside the session's virtualenv dir (``TMPDIR`` is left alone)."""
    path = Path(session.virtualenv.location) / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _junit_path(name: str) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    return RESULTS_DIR / f"{name}.xml"


def _session_env(session: nox.Session, constraints: Path = CONSTRAINTS) -> None:
    session.env["PIP_CONSTRAINT"] = str(constraints)
    session.env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    session.env["PIP_NO_INPUT"] = "1"
    # pip installs without byte-compiling (--no-compile, _install): torch and transformers
    # ship thousands of modules a test run never imports. Python compiles what is imported,
    # once per session, into this prefix (never into the source tree), and every later
    # process of the session (the distributed tests' ranks) reads it from there.
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty: unset, whatever the caller exported
    session.env["PYTHONPYCACHEPREFIX"] = str(_work_dir(session, "pycache"))
    # The distributed tests' fork server imports these once (colossal.core.testing.spawn);
    # each rank would otherwise import them again: seconds per rank, most of a test's time.
    session.env["COLOSSAL_TEST_PRELOAD"] = ",".join(TEST_PRELOAD)


def _install(session: nox.Session, *args: str) -> None:
    """``pip install`` into the session, without byte-compiling (see ``_session_env``)."""
    session.install("--no-compile", *args)


def _install_torch(session: nox.Session) -> None:
    """Install the pinned torch before anything else can pull in another build."""
    _install(session, "-c", str(CONSTRAINTS), "--only-binary", "torch", TORCH)
    session.run(
        "python",
        "-c",
        "import torch; v = torch.__version__; print('torch', v);"
        f" assert v.split('+')[0] == {TORCH.split('==')[1]!r}, v",
    )


def _build_wheels(
    session: nox.Session, dists: list[str], constraints: Path = CONSTRAINTS
) -> dict[str, Path]:
    """Build one wheel per distribution into the session's temp dir; returns dist -> wheel."""
    packages = discover_packages()
    build_requires = sorted({r for d in dists for r in packages[d].build_requires})
    _install(session, "-c", str(constraints), "-c", str(DEV_REQUIREMENTS), *build_requires)
    wheel_dir = _work_dir(session, "wheels")
    session.run(
        "python",
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        str(wheel_dir),
        *(str(packages[d].path) for d in dists),
    )
    wheels: dict[str, Path] = {}
    for wheel in wheel_dir.glob("*.whl"):
        wheels[canonicalize_name(parse_wheel_filename(wheel.name)[0])] = wheel
    missing = sorted(set(dists) - set(wheels))
    if missing:
        session.error(f"no wheel was built for {', '.join(missing)} in {wheel_dir}")
    return wheels


def _install_wheels(
    session: nox.Session,
    wheels: dict[str, Path],
    extra_requirements: list[Requirement],
    constraints: Path = CONSTRAINTS,
) -> None:
    """Install the local wheels by path together with the other requirements, in one go.

    A requirement on a sibling (``colossal*``) is satisfied by its local wheel; extras asked
    for it are attached to the wheel path.
    """
    sibling_extras: dict[str, set[str]] = {}
    others: list[str] = []
    for req in extra_requirements:
        if _is_sibling(req):
            sibling_extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
        else:
            others.append(str(req))
    args = []
    for dist, wheel in sorted(wheels.items()):
        extras = sorted(sibling_extras.get(dist, ()))
        args.append(f"{wheel}[{','.join(extras)}]" if extras else str(wheel))
    _install(session, "-c", str(constraints), "-c", str(DEV_REQUIREMENTS), *args, *others, "pytest")


def _check_imports(session: nox.Session, modules: list[str], forbidden: tuple[str, ...]) -> None:
    """Import the installed packages from an empty directory; they must come from the venv."""
    code = "\n".join(
        [
            "import importlib, sys",
            f"modules = {modules!r}",
            "for name in modules:",
            "    mod = importlib.import_module(name)",
            "    where = mod.__file__ or ''",
            "    assert 'site-packages' in where, f'{name} imported from {where}, not the venv'",
            "    print('imported', name, 'from', where)",
            "import colossal",
            "assert getattr(colossal, '__file__', None) is None, (",
            "    f'colossal must be a PEP 420 namespace, but {colossal.__file__} exists')",
            f"bad = [m for m in {list(forbidden)!r} if m in sys.modules]",
            "assert not bad, f'importing {modules} also imported {bad} (must load lazily)'",
        ]
    )
    with session.chdir(_work_dir(session, "import-check")):
        session.run("python", "-c", code)


def _run_pytest(
    session: nox.Session,
    target: Path | list[Path],
    junit_name: str,
    success_codes: tuple[int, ...] = (0,),
) -> Path:
    """Run pytest on ``target`` (a directory, test files or node ids) from an empty directory.

    Returns the JUnit XML path.

    The working directory is outside the source tree, so only the installed wheels provide
    ``colossal.*``. pytest's default ``prepend`` import mode puts the tests directory itself on
    ``sys.path``, which spawned worker processes need to re-import test modules by name.
    """
    junit = _junit_path(junit_name)
    junit.unlink(missing_ok=True)
    with session.chdir(_work_dir(session, "pytest-cwd")):
        session.run(
            "python",
            "-m",
            "pytest",
            *(str(t) for t in (target if isinstance(target, list) else [target])),
            f"--junitxml={junit}",
            "-o",
            f"junit_suite_name={junit_name}",
            "-p",
            "no:cacheprovider",
            "-ra",
            *session.posargs,
            success_codes=list(success_codes),
        )
    return junit


def _constraints_without(session: nox.Session, name: str) -> Path:
    """``constraints.txt`` minus the pin of ``name``, written into the session's virtualenv."""
    kept = []
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec and canonicalize_name(Requirement(spec).name) == canonicalize_name(name):
            continue
        kept.append(line)
    path = _work_dir(session, "constraints") / "constraints.txt"
    path.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return path


def _collected_no_tests(junit: Path) -> bool:
    if not junit.is_file():
        return True
    try:
        return not any(True for _ in ET.parse(junit).getroot().iter("testcase"))
    except ET.ParseError:
        return False


# -- sessions -----------------------------------------------------------------------------------


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff over the whole repository (config in the root pyproject.toml)."""
    _session_env(session)
    _install(session, "-c", str(DEV_REQUIREMENTS), "ruff")
    session.run("ruff", "--version")
    session.run("ruff", "check", str(REPO), *session.posargs)


@nox.session
def layering(session: nox.Session) -> None:
    """The import layering check (DESIGN.md table), the ``Any`` count, the migration page's
    currency and the tools' tests."""
    _session_env(session)
    _install(session, "-c", str(DEV_REQUIREMENTS), "pytest")
    session.run("python", str(REPO / "tools" / "check_layering.py"), "--root", str(REPO))
    session.run(
        "python",
        str(REPO / "tools" / "count_any.py"),
        "--root",
        str(REPO),
        "--max",
        str(MAX_PUBLIC_ANY),
    )
    # the migration page is generated from the compat name table: it must be current
    session.run("python", str(REPO / "tools" / "compat_table.py"), "--check")
    _run_pytest(session, REPO / "tools" / "tests", "layering")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's ``src`` (config: the root pyproject.toml ``[tool.mypy]``).

    The ``colossal`` namespace is spread over eight distributions, so one mypy run sees all of
    ``packages/*/src`` (``mypy_path``) and checks imports between packages against this
    checkout's source; no wheels are built. The venv holds torch (installed first) and the
    third-party runtime dependencies of every package, whose inline types mypy reads, and
    pytest (``colossal.core.testing`` supports it).
    """
    _session_env(session)
    packages = discover_packages()
    for pkg in packages.values():
        if pkg.problem is not None:
            session.error(pkg.problem)
    _install_torch(session)
    third_party = sorted(
        {str(r) for p in packages.values() for r in p.dependencies if not _is_sibling(r)}
    )
    # pytest: colossal.core.testing's pytest support imports it (typed inline).
    _install(session, "-c", str(CONSTRAINTS), "-c", str(DEV_REQUIREMENTS), "mypy", "pytest",
                    *third_party)
    session.run("mypy", "--version")
    junit = _junit_path("typecheck")
    junit.unlink(missing_ok=True)
    session.run(
        "mypy",
        "--config-file",
        str(REPO / "pyproject.toml"),
        "--cache-dir",
        str(_work_dir(session, "mypy-cache")),
        f"--junit-xml={junit}",
        *session.posargs,
    )


@nox.session
@nox.parametrize("package", sorted(discover_packages()))
def tests(session: nox.Session, package: str) -> None:
    """One package's tests against its installed wheel (and its sibling wheels)."""
    _session_env(session)
    pkg = discover_packages()[package]
    tests_dir = pkg.path / "tests"
    if not tests_dir.is_dir():
        session.error(f"{tests_dir.relative_to(REPO)} does not exist: every package has tests")
    dists = sibling_closure(session, [package, *_sibling_names(pkg.test_requirements)])
    _install_torch(session)
    session.log(f"building wheels: {', '.join(dists)}")
    wheels = _build_wheels(session, dists)
    _install_wheels(session, wheels, list(pkg.test_requirements))
    _check_imports(session, list(pkg.import_names), MUST_STAY_UNIMPORTED.get(package, ()))
    _run_pytest(session, tests_dir, f"tests-{package}")


@nox.session
def integration(session: nox.Session) -> None:
    """End-to-end tests with every package installed together (the meta-package included)."""
    _session_env(session)
    packages = discover_packages()
    dists = sibling_closure(session, sorted(packages))
    _install_torch(session)
    wheels = _build_wheels(session, dists)
    test_requirements = [r for p in packages.values() for r in p.test_requirements]
    _install_wheels(session, wheels, test_requirements)
    requirements_txt = INTEGRATION_DIR / "requirements.txt"
    if requirements_txt.is_file():
        _install(session, "-c", str(CONSTRAINTS), "-r", str(requirements_txt))
    session.run("python", "-m", "pip", "check")
    modules = sorted({m for p in packages.values() for m in p.import_names})
    _check_imports(session, modules, ())
    rel = INTEGRATION_DIR.relative_to(REPO)
    if not INTEGRATION_DIR.is_dir():
        session.log(
            f"NOTE: {rel}/ does not exist yet: all packages install and import together, but "
            "there are no integration tests to run."
        )
        return
    has_test_files = any(INTEGRATION_DIR.rglob("test_*.py")) or any(
        INTEGRATION_DIR.rglob("*_test.py")
    )
    # Only while integration-tests/ holds no test files, "no tests collected" is a success.
    codes = (0,) if has_test_files else (0, PYTEST_NO_TESTS)
    junit = _run_pytest(session, INTEGRATION_DIR, "integration", success_codes=codes)
    if not has_test_files and _collected_no_tests(junit):
        session.log(
            f"NOTE: {rel}/ has no test files yet, so pytest collected nothing (exit "
            f"{PYTEST_NO_TESTS}); accepted in the integration session only."
        )


@nox.session
def newest_transformers(session: nox.Session) -> None:
    """The shardformer and hybrid tests against the newest ``transformers<6`` of the index.

    ``constraints.txt`` pins the transformers release CI was last checked with; users who
    follow the README get the newest one. This session drops that pin (torch stays pinned
    and is installed first), installs ``transformers>=5,<6`` fresh, logs the version it got,
    and runs ``NEWEST_TRANSFORMERS_TESTS`` against the installed wheels.
    """
    packages = discover_packages()
    constraints = _constraints_without(session, UNPINNED)
    _session_env(session, constraints)
    roots = list(NEWEST_TRANSFORMERS_TESTS)
    test_requirements = [r for d in roots for r in packages[d].test_requirements]
    dists = sibling_closure(session, [*roots, *_sibling_names(tuple(test_requirements))])
    _install_torch(session)
    wheels = _build_wheels(session, dists, constraints)
    newest = [*test_requirements, Requirement(NEWEST_TRANSFORMERS)]
    _install_wheels(session, wheels, newest, constraints)
    session.run(
        "python",
        "-c",
        "import torch, transformers; print('transformers', transformers.__version__);"
        f" assert torch.__version__.split('+')[0] == {TORCH.split('==')[1]!r}, torch.__version__",
    )
    for dist, entries in NEWEST_TRANSFORMERS_TESTS.items():
        tests_dir = packages[dist].path / "tests"
        targets: list[Path] = []
        for entry in entries:
            pattern, sep, test = entry.partition("::")
            files = sorted(tests_dir.glob(pattern))
            if not files:  # a renamed file must not silently drop out of the session
                session.error(f"{entry!r} matches nothing in {tests_dir.relative_to(REPO)}")
            targets.extend(Path(f"{f}{sep}{test}") for f in files)
        _run_pytest(session, targets, f"newest-transformers-{dist}")
