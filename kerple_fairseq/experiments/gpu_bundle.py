"""What a GPU machine without network installs from: the *bundle*.

``scripts/prepare-gpu-bundle.sh`` makes it on a machine with access to PyPI, ``scripts/gpu-check.sh``
installs from it. It holds, for the GPU machine's Python (:data:`TARGET_PYTHON`, x86-64 Linux):

- ``sdist/``: fairseq's source distribution, built there against the machine's own PyTorch;
- ``wheels/``: the Python packages that machine lacks (:data:`PINS`; what it already has is
  :data:`ON_THE_MACHINE`);
- ``wikitext-103-sample/``: the WikiText-103 sample (``wiki.{train,valid,test}.tokens``);
- ``manifest.json``: each file with its version and SHA-256.

Installing refuses anything the manifest does not name, and any package of the machine's PyTorch and
CUDA stack (:data:`PROTECTED`). It runs before fairseq is installed, so this module imports nothing of
fairseq's or the plugin's.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Sequence

from kerple_fairseq.experiments.paths import sample_places

TARGET_PYTHON = "3.12"
#: the wheel tags pip accepts for the machine (manylinux x86-64; pure-Python wheels match any)
TARGET_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux1_x86_64")
MANIFEST = "manifest.json"
SAMPLE = "wikitext-103-sample"
SAMPLE_FILES = ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")


class Pin(NamedTuple):
    name: str
    version: str
    #: "wheel" from PyPI, "pure wheel" built here from PyPI's source (a py3-none-any wheel: PyPI has
    #: no wheel of it), or "sdist", built on the GPU machine
    form: str


PINS = (
    Pin("fairseq-fixed", "0.12.3.1", "sdist"),  # setup.py's fairseq on Python 3.11+
    Pin("numpy", "1.26.4", "wheel"),  # setup.py: numpy<2 (fairseq 0.12 calls np.compat)
    Pin("hydra-core", "1.3.2", "wheel"),  # fairseq-fixed's own pins
    Pin("omegaconf", "2.3.0", "wheel"),
    Pin("antlr4-python3-runtime", "4.9.3", "pure wheel"),  # hydra-core's and omegaconf's ==4.9.*
    Pin("bitarray", "3.12.3", "wheel"),  # the rest of fairseq-fixed's requirements
    Pin("cffi", "2.1.1", "wheel"),
    Pin("pycparser", "3.12", "wheel"),  # cffi's
    Pin("sacremoses", "0.2.0", "wheel"),  # setup.py
)
#: what the GPU machine's image already holds of the requirements of fairseq-fixed, kerple-fairseq
#: (its tests included) and the pinned packages (``scripts/gpu-check.sh`` checks they are there)
ON_THE_MACHINE = ("torch", "torchaudio", "cython", "setuptools", "wheel", "packaging", "regex", "sacrebleu",
                  "scikit-learn", "tqdm", "tensorboard", "pyyaml", "click", "joblib", "pytest")
#: never installed from a bundle: the machine's PyTorch and its CUDA stack (also any ``nvidia-*``, ``cuda-*``)
PROTECTED = ("torch", "torchaudio", "torchvision", "triton")


class BundleError(Exception):
    """The bundle is incomplete or altered, or installing it would touch what it must not."""


class InstallFailed(Exception):
    """pip failed on a bundle it was allowed to install (a build error, say)."""


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def protected(name: str) -> bool:
    name = canonical(name)
    return name in PROTECTED or name.startswith(("nvidia-", "cuda-"))


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------ preparing (with PyPI)


def fetch(pin: Pin, folder: Path, python: str = sys.executable) -> Path:
    """Download (or, for a "pure wheel", build) ``pin`` into ``folder``; returns the file."""
    requirement = f"{pin.name}=={pin.version}"
    with tempfile.TemporaryDirectory() as tmp:
        if pin.form == "wheel":
            target = [f"--python-version={TARGET_PYTHON}", "--implementation=cp",
                      *(f"--platform={p}" for p in TARGET_PLATFORMS)]
            cmd = ["download", "--no-deps", "--only-binary=:all:", *target, "-d", tmp, requirement]
        elif pin.form == "pure wheel":
            cmd = ["wheel", "--no-deps", "--no-binary=:all:", "-w", tmp, requirement]
        else:  # its metadata is built without isolation, against the torch of this environment
            cmd = ["download", "--no-deps", "--no-binary=:all:", "--no-build-isolation", "-d", tmp, requirement]
        proc = subprocess.run([python, "-m", "pip", "-q", *cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BundleError(f"pip could not get {requirement}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
        (got,) = Path(tmp).iterdir()
        if pin.form == "pure wheel" and not got.name.endswith("-py3-none-any.whl"):
            raise BundleError(f"{got.name} is not a pure-Python wheel: it would not install on the GPU machine")
        folder.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(str(got), folder / got.name))


def find_sample(repo: Path) -> Path:
    """The WikiText-103 sample, in the first of :func:`~kerple_fairseq.experiments.paths.sample_places`
    that holds it."""
    places = sample_places(repo)
    for place in places:
        if all((place / name).is_file() for name in SAMPLE_FILES):
            return place
    raise BundleError(f"no WikiText-103 sample in {' or '.join(map(str, places))}: run "
                      "bash scripts/run-small-comparison.sh, which downloads it, or set KERPLE_WIKITEXT_DIR")


def prepare(bundle: Path, sample: Path, log=print, python: str = sys.executable) -> Dict:
    """Make ``bundle`` hold exactly the :data:`PINS` and ``sample``'s files, fetching only what it lacks
    or holds in another version, and write its manifest last (until then, :func:`verify` fails on a
    bundle changed half-way). Returns the manifest."""
    old = read_manifest(bundle) if (bundle / MANIFEST).is_file() else {"packages": [], "sample": {}}
    same_target = old.get("python") == TARGET_PYTHON
    kept = {(p["name"], p["version"]): p for p in old["packages"]
            if same_target and (bundle / p["file"]).is_file() and sha256(bundle / p["file"]) == p["sha256"]}
    packages = []
    for pin in PINS:
        entry = kept.get((pin.name, pin.version))
        if entry is None:
            log(f"fetching {pin.name}=={pin.version} ({pin.form})")
            path = fetch(pin, bundle / ("sdist" if pin.form == "sdist" else "wheels"), python)
            entry = {"name": pin.name, "version": pin.version, "form": pin.form,
                     "file": path.relative_to(bundle).as_posix(), "sha256": sha256(path)}
        packages.append(entry)
    files = {p["file"] for p in packages}
    for folder in ("sdist", "wheels"):
        for path in sorted((bundle / folder).glob("*")):
            if path.relative_to(bundle).as_posix() not in files:
                log(f"removing {path.name} (not pinned)")
                path.unlink()
    (bundle / SAMPLE).mkdir(parents=True, exist_ok=True)
    sample_sums = {}
    for name in SAMPLE_FILES:
        source, copy = sample / name, bundle / SAMPLE / name
        sample_sums[name] = sha256(source)
        if not copy.is_file() or old["sample"].get(name) != sample_sums[name] or sha256(copy) != sample_sums[name]:
            log(f"copying {source}")
            shutil.copyfile(source, copy)
    manifest = {"python": TARGET_PYTHON, "platforms": list(TARGET_PLATFORMS), "packages": packages,
                "sample": sample_sums}
    partial = bundle / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    partial.rename(bundle / MANIFEST)
    return manifest


# ------------------------------------------------------------------ checking (anywhere)


def read_manifest(bundle: Path) -> Dict:
    path = bundle / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle} holds no complete bundle (no {MANIFEST}): run bash scripts/prepare-gpu-bundle.sh "
                          "on a machine with access to PyPI, and carry the folder")
    return json.loads(path.read_text())


def verify(bundle: Path) -> Dict:
    """The manifest, once every file it names is there unaltered and ``sdist/`` and ``wheels/`` hold
    nothing else; raises :class:`BundleError` otherwise, or where it names a :data:`PROTECTED` package."""
    manifest = read_manifest(bundle)
    named = {p["file"]: p["sha256"] for p in manifest["packages"]}
    named.update({f"{SAMPLE}/{name}": digest for name, digest in manifest["sample"].items()})
    for file, digest in named.items():
        if not (bundle / file).is_file():
            raise BundleError(f"{bundle / file} is missing")
        if sha256(bundle / file) != digest:
            raise BundleError(f"{bundle / file} differs from the one the manifest names")
    extra = sorted(p.relative_to(bundle).as_posix() for folder in ("sdist", "wheels")
                   for p in (bundle / folder).glob("*") if p.relative_to(bundle).as_posix() not in named)
    if extra:
        raise BundleError(f"refusing to install from {bundle}: not in its manifest: {', '.join(extra)}")
    refuse_protected(p["name"] for p in manifest["packages"])
    return manifest


def refuse_protected(names: Iterable[str]) -> None:
    touched = sorted(n for n in names if protected(n))
    if touched:
        raise BundleError(f"refusing to install {', '.join(touched)}: the machine's PyTorch and CUDA stack "
                          "are never replaced")


def files(bundle: Path, manifest: Dict, forms: Sequence[str]) -> List[str]:
    return [str(bundle / p["file"]) for p in manifest["packages"] if p["form"] in forms]


def pip_plan(python: str, args: Sequence[str]) -> Dict[str, str]:
    """What ``pip install --dry-run ARGS`` would install, by canonical name: version."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([python, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), *args],
                              capture_output=True, text=True, env=offline_pip_environment())
        if proc.returncode != 0:
            raise BundleError(f"pip refused the bundle: {(proc.stderr or proc.stdout).strip()[-2000:]}")
        installs = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def check_plan(plan: Dict[str, str], manifest: Dict, forms: Sequence[str]) -> None:
    """pip's ``plan`` installs the manifest's packages of ``forms``, in their versions, and nothing else."""
    refuse_protected(plan)
    expected = {canonical(p["name"]): p["version"] for p in manifest["packages"] if p["form"] in forms}
    if plan != expected:
        raise BundleError(f"refusing to install: pip would install {sorted(plan.items())}, the manifest names "
                          f"{sorted(expected.items())}")


def check_for_target(bundle: Path, manifest: Dict, python: str = sys.executable) -> None:
    """From any machine: pip takes every wheel of the bundle for the GPU machine's Python and platform
    (the source distribution is built only there)."""
    forms = ("wheel", "pure wheel")
    target = [f"--python-version={TARGET_PYTHON}", "--implementation=cp", "--only-binary=:all:",
              *(f"--platform={p}" for p in TARGET_PLATFORMS)]
    plan = pip_plan(python, ["--no-index", "--no-deps", "--ignore-installed", *target, *files(bundle, manifest, forms)])
    check_plan(plan, manifest, forms)


def offline_pip_environment() -> Dict[str, str]:
    """This environment without pip's settings (no configuration file, no ``PIP_*``): only the command line counts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


# ------------------------------------------------------------------ installing (on the GPU machine)


def install_commands(bundle: Path, manifest: Dict, repo: Path, python: str) -> List[List[str]]:
    """The wheels; then fairseq, built against the machine's torch (and the numpy just installed); then
    this checkout (afresh: its version number does not change with its code). Only from the files
    named, never from an index, never their dependencies."""
    pip = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--no-build-isolation"]
    return [pip + ["--upgrade", *files(bundle, manifest, ("wheel", "pure wheel"))],
            pip + files(bundle, manifest, ("sdist",)), pip + ["--force-reinstall", str(repo)]]


def build_environment() -> Dict[str, str]:
    """fairseq's build: every core, and without its CUDA extensions (non-autoregressive translation's
    edit distance and generation's n-gram blocking, which has a Python fallback), which setup.py
    builds only where ``CUDA_HOME`` is set."""
    env = offline_pip_environment()
    env.pop("CUDA_HOME", None)
    env["MAX_JOBS"] = str(os.cpu_count() or 1)
    return env


def install(bundle: Path, repo: Path, python: str = sys.executable, log=print) -> None:
    """Install the verified bundle, then this checkout, into ``python``'s environment, after pip's own
    plan for them is checked against the manifest; raises :class:`BundleError` before installing
    anything it refuses, or if the machine's torch changed, and :class:`InstallFailed` if pip fails."""
    manifest = verify(bundle)
    every = ("wheel", "pure wheel", "sdist")
    check_plan(pip_plan(python, ["--no-index", "--no-deps", "--no-build-isolation", "--ignore-installed",
                                 *files(bundle, manifest, every)]), manifest, every)
    torch_before = installed_version("torch")
    for cmd in install_commands(bundle, manifest, repo, python):
        log("$ " + " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=build_environment())
        if proc.returncode != 0:
            raise InstallFailed(f"pip failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    if installed_version("torch") != torch_before:
        raise BundleError(f"torch changed from {torch_before} to {installed_version('torch')}")


def installed_version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def unmet_requirements(distributions: Sequence[str] = ("fairseq-fixed", "kerple-fairseq")) -> List[str]:
    """The requirements of ``distributions`` (and their ``test`` extra) that this environment does not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement

    unmet = []
    for distribution in distributions:
        try:
            requires = metadata.requires(distribution) or []
        except metadata.PackageNotFoundError:
            unmet.append(f"{distribution} (not installed)")
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({"extra": "test"}):
                continue
            version = installed_version(requirement.name)
            if version == "absent" or not requirement.specifier.contains(version, prereleases=True):
                unmet.append(f"{requirement} of {distribution} ({version})")
    return unmet


def unbundled_requirements(bundle: Path, manifest: Dict, more: Sequence[str] = ()) -> List[str]:
    """Requirements, on the GPU machine's Python, of the bundle's packages and ``more`` requirement
    strings (kerple-fairseq's) that neither the bundle nor :data:`ON_THE_MACHINE` provides, or that a
    pinned version does not meet."""
    from packaging.requirements import Requirement

    environment = {"python_version": TARGET_PYTHON, "python_full_version": TARGET_PYTHON + ".0",
                   "implementation_name": "cpython", "platform_python_implementation": "CPython",
                   "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    pinned = {canonical(p["name"]): p["version"] for p in manifest["packages"]}
    texts = [(text, p["name"]) for p in manifest["packages"] for text in declared_requirements(bundle / p["file"])]
    texts += [(text, "kerple-fairseq") for text in more]
    unbundled = []
    for text, owner in texts:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        name = canonical(requirement.name)
        if name in pinned:
            if not requirement.specifier.contains(pinned[name], prereleases=True):
                unbundled.append(f"{requirement} of {owner} (bundled: {pinned[name]})")
        elif name not in ON_THE_MACHINE:
            unbundled.append(f"{requirement} of {owner}")
    return unbundled


def declared_requirements(path: Path) -> List[str]:
    """``Requires-Dist`` of a wheel's METADATA or a source distribution's PKG-INFO."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(name).decode()
    else:
        with tarfile.open(path) as t:
            member = min((m for m in t.getmembers() if m.name.endswith("/PKG-INFO")), key=lambda m: m.name.count("/"))
            text = t.extractfile(member).read().decode()
    headers = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in headers.splitlines() if line.startswith("Requires-Dist:")]
