"""What a GPU machine without network installs from: the *bundle*.

``scripts/prepare-gpu-bundle.sh`` makes it on a machine with access to PyPI, ``scripts/gpu-check.sh``
installs from it. It holds, for the GPU machine's Python (:data:`TARGET_PYTHON`, x86-64 Linux):

- ``wheels/``: the Python packages that machine lacks (:data:`PINS`; what it already has is
  :data:`ON_THE_MACHINE`), fairseq among them as a wheel *built here* by the *builder*, a Python of
  the GPU image's versions (:data:`IMAGE`: ``scripts/gpu-check.sh --rehearse`` makes one), so that
  nothing is compiled on the GPU machine;
- ``wikitext-103-sample/``: the WikiText-103 sample (``wiki.{train,valid,test}.tokens``);
- ``manifest.json``: each file with its version and SHA-256.

Installing refuses anything the manifest does not name and any package of the machine's PyTorch and
CUDA stack (:data:`PROTECTED`), and installs only what the environment lacks: a package it already
holds, in whatever version, is kept as it is (NumPy 2 included). It runs before fairseq is installed,
so this module imports nothing of fairseq's or the plugin's.
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
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

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
    #: "wheel" from PyPI; "pure wheel" built here from PyPI's source (a py3-none-any wheel: PyPI has
    #: no wheel of it); "built wheel", built here by the builder against the GPU image's PyTorch and NumPy
    form: str


PINS = (
    Pin("fairseq-fixed", "0.12.3.1", "built wheel"),  # setup.py's fairseq on Python 3.11+
    Pin("hydra-core", "1.3.2", "wheel"),  # fairseq-fixed's own pins
    Pin("omegaconf", "2.3.0", "wheel"),
    Pin("antlr4-python3-runtime", "4.9.3", "pure wheel"),  # hydra-core's and omegaconf's ==4.9.*
    Pin("bitarray", "3.12.3", "wheel"),  # the rest of fairseq-fixed's requirements
    Pin("cffi", "2.1.1", "wheel"),
    Pin("pycparser", "3.12", "wheel"),  # cffi's
    Pin("sacremoses", "0.2.0", "wheel"),  # setup.py
)
#: the GPU image's own versions of what the plugin and fairseq rest on (Python 3.12.3); the builder,
#: and the rehearsal's environment, hold these
IMAGE = ("torch==2.11.0", "torchaudio==2.11.0", "numpy==2.5.2", "triton==3.6.0", "scipy", "scikit-learn", "pandas",
         "matplotlib", "tensorboard", "sacrebleu", "regex", "tqdm", "pyyaml", "click", "joblib", "packaging",
         "cython", "setuptools", "wheel", "pytest", "pytest-timeout", "pytest-xdist", "ninja")
#: what the GPU machine's image already holds of the requirements of fairseq-fixed, kerple-fairseq
#: (its tests included) and the pinned packages (``scripts/gpu-check.sh`` checks they are there)
ON_THE_MACHINE = ("torch", "torchaudio", "numpy", "cython", "setuptools", "wheel", "packaging", "regex", "sacrebleu",
                  "scikit-learn", "tqdm", "tensorboard", "pyyaml", "click", "joblib", "pytest", "matplotlib")
#: never installed from a bundle: the machine's PyTorch and its CUDA stack (also any ``nvidia-*``, ``cuda-*``)
PROTECTED = ("torch", "torchaudio", "torchvision", "triton", "numpy")


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


def fetch(pin: Pin, folder: Path, builder: Optional[str]) -> Path:
    """Download or build ``pin`` into ``folder``; returns the file. A "built wheel" needs ``builder``."""
    requirement = f"{pin.name}=={pin.version}"
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        if pin.form == "wheel":
            target = [f"--python-version={TARGET_PYTHON}", "--implementation=cp",
                      *(f"--platform={p}" for p in TARGET_PLATFORMS)]
            cmd = ["download", "--no-deps", "--only-binary=:all:", *target, "-d", tmp, requirement]
        elif pin.form == "pure wheel":
            cmd = ["wheel", "--no-deps", "--no-binary=:all:", "-w", tmp, requirement]
        else:  # compiled against the builder's torch and numpy, without an isolated build environment
            if builder is None:
                raise BundleError(f"{requirement} is built by a Python {TARGET_PYTHON} holding the GPU image's "
                                  "packages: run bash scripts/gpu-check.sh --rehearse, which makes one, or pass "
                                  "--builder PYTHON")
            python = builder
            cmd = ["wheel", "--no-deps", "--no-binary=:all:", "--no-build-isolation", "--no-cache-dir", "-w", tmp,
                   requirement]
        proc = subprocess.run([python, "-m", "pip", "-q", *cmd], capture_output=True, text=True,
                              env=build_environment())
        if proc.returncode != 0:
            raise BundleError(f"pip could not get {requirement}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
        (got,) = Path(tmp).iterdir()
        if pin.form == "pure wheel" and not got.name.endswith("-py3-none-any.whl"):
            raise BundleError(f"{got.name} is not a pure-Python wheel: it would not install on the GPU machine")
        tag = "cp" + TARGET_PYTHON.replace(".", "")
        if pin.form == "built wheel" and f"-{tag}-{tag}-linux_x86_64.whl" not in got.name:
            raise BundleError(f"{got.name} is not for CPython {TARGET_PYTHON} on x86-64 Linux: the builder "
                              f"{builder} is not a Python {TARGET_PYTHON} on x86-64")
        folder.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(str(got), folder / got.name))


def find_sample(repo: Path) -> Path:
    """The WikiText-103 sample: ``$KERPLE_WIKITEXT_DIR``, else ``../shared/data/wikitext-103-sample``
    beside the checkout, else ``downloads/wikitext-103-sample`` (the small comparison's download)."""
    places = ([Path(os.environ["KERPLE_WIKITEXT_DIR"])] if os.environ.get("KERPLE_WIKITEXT_DIR") else
              [repo.parent / "shared" / "data" / SAMPLE, repo / "downloads" / SAMPLE])
    for place in places:
        if all((place / name).is_file() for name in SAMPLE_FILES):
            return place
    raise BundleError(f"no WikiText-103 sample in {' or '.join(map(str, places))}: run "
                      "bash scripts/run-small-comparison.sh, which downloads it, or set KERPLE_WIKITEXT_DIR")


def image_pins() -> List[str]:
    """The GPU image's versions that a built wheel depends on."""
    return [r for r in IMAGE if "==" in r]


def builder_versions(builder: str) -> Dict[str, str]:
    """The versions of :data:`IMAGE`'s pinned packages in the builder's environment."""
    names = [r.split("==")[0] for r in image_pins()]
    code = ("import json, sys; from importlib import metadata as m\n"
            "def v(n):\n try: return m.version(n)\n except m.PackageNotFoundError: return 'absent'\n"
            f"print(json.dumps({{'python': '%d.%d' % sys.version_info[:2], **{{n: v(n) for n in {names!r}}}}}))")
    proc = subprocess.run([builder, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"the builder {builder} does not run: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def check_builder(builder: str) -> None:
    """The builder is a Python :data:`TARGET_PYTHON` with :data:`IMAGE`'s pinned versions (those the built
    wheel's compiled parts depend on)."""
    versions = builder_versions(builder)
    wrong = []
    if versions["python"] != TARGET_PYTHON:
        wrong.append(f"python {versions['python']} (the image's: {TARGET_PYTHON})")
    wrong += [f"{r.split('==')[0]} {versions[r.split('==')[0]]} (the image's: {r.split('==')[1]})"
              for r in image_pins() if versions[r.split("==")[0]].split("+")[0] != r.split("==")[1]]
    if wrong:
        raise BundleError(f"the builder {builder} differs from the GPU image: {', '.join(wrong)}; "
                          "bash scripts/gpu-check.sh --rehearse makes one that does not")


def prepare(bundle: Path, sample: Path, builder: Optional[str] = None, log=print, build: bool = True) -> Dict:
    """Make ``bundle`` hold exactly the :data:`PINS` and ``sample``'s files, fetching or building only
    what it lacks or holds in another version, and write its manifest last (until then, :func:`verify`
    fails on a bundle changed half-way). Returns the manifest. Without ``build``, a "built wheel" the
    bundle lacks is left out of it (said in the log): a dry run's bundle, incomplete for the GPU."""
    old = read_manifest(bundle) if (bundle / MANIFEST).is_file() else {"packages": [], "sample": {}}
    same_target = old.get("python") == TARGET_PYTHON and old.get("image") == image_pins()
    kept = {(p["name"], p["version"], p["form"]): p for p in old["packages"]
            if same_target and (bundle / p["file"]).is_file() and sha256(bundle / p["file"]) == p["sha256"]}
    packages = []
    for pin in PINS:
        entry = kept.get(tuple(pin))
        if entry is None and pin.form == "built wheel" and not build:
            log(f"not building {pin.name}=={pin.version}: no builder here (bash scripts/gpu-check.sh --rehearse "
                "builds it)")
            continue
        if entry is None:
            log(f"{'building' if pin.form == 'built wheel' else 'fetching'} {pin.name}=={pin.version} ({pin.form})")
            if pin.form == "built wheel" and builder is not None:
                check_builder(builder)
            path = fetch(pin, bundle / "wheels", builder)
            entry = {"name": pin.name, "version": pin.version, "form": pin.form,
                     "file": path.relative_to(bundle).as_posix(), "sha256": sha256(path)}
        packages.append(entry)
    files = {p["file"] for p in packages}
    for path in sorted((bundle / "wheels").glob("*")):
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
    manifest = {"python": TARGET_PYTHON, "platforms": list(TARGET_PLATFORMS), "image": image_pins(),
                "packages": packages, "sample": sample_sums}
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
    """The manifest, once every file it names is there unaltered and ``wheels/`` holds nothing else;
    raises :class:`BundleError` otherwise, or where it names a :data:`PROTECTED` package."""
    manifest = read_manifest(bundle)
    named = {p["file"]: p["sha256"] for p in manifest["packages"]}
    named.update({f"{SAMPLE}/{name}": digest for name, digest in manifest["sample"].items()})
    for file, digest in named.items():
        if not (bundle / file).is_file():
            raise BundleError(f"{bundle / file} is missing")
        if sha256(bundle / file) != digest:
            raise BundleError(f"{bundle / file} differs from the one the manifest names")
    extra = sorted(p.relative_to(bundle).as_posix() for p in (bundle / "wheels").glob("*")
                   if p.relative_to(bundle).as_posix() not in named)
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
    """From any machine: pip takes every wheel of the bundle for the GPU machine's Python and platform."""
    forms = ("wheel", "pure wheel", "built wheel")
    target = [f"--python-version={TARGET_PYTHON}", "--implementation=cp", "--only-binary=:all:",
              *(f"--platform={p}" for p in (*TARGET_PLATFORMS, "linux_x86_64"))]
    plan = pip_plan(python, ["--no-index", "--no-deps", "--ignore-installed", *target, *files(bundle, manifest, forms)])
    check_plan(plan, manifest, forms)


def offline_pip_environment() -> Dict[str, str]:
    """This environment without pip's settings (no configuration file, no ``PIP_*``): only the command line counts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def build_environment() -> Dict[str, str]:
    """fairseq's build: every core, and without its CUDA extensions (non-autoregressive translation's
    edit distance and generation's n-gram blocking, which has a Python fallback), which setup.py
    builds only where ``CUDA_HOME`` is set."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env["MAX_JOBS"] = str(os.cpu_count() or 1)
    return env


# ------------------------------------------------------------------ installing (on the GPU machine)


def pip_reports(python: str) -> bool:
    """Whether ``python``'s pip plans an install without making it (``--dry-run --report``, pip 22.2 on);
    without, the manifest's own check stands alone."""
    proc = subprocess.run([python, "-c", "import pip; print(pip.__version__)"], capture_output=True, text=True)
    try:
        return tuple(int(x) for x in proc.stdout.strip().split(".")[:2]) >= (22, 2)
    except ValueError:
        return False


def snapshot(python: str) -> Dict[str, str]:
    """Every distribution of ``python``'s environment: canonical name -> version."""
    proc = subprocess.run([python, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                          capture_output=True, text=True, env=offline_pip_environment())
    if proc.returncode != 0:
        raise InstallFailed(f"pip list failed: {proc.stderr.strip()[-1000:]}")
    return {canonical(d["name"]): d["version"] for d in json.loads(proc.stdout)}


def changed(before: Dict[str, str], after: Dict[str, str], own: str = "kerple-fairseq") -> List[str]:
    """What installing changed of what was there before (``own``, this checkout, excepted): each
    package removed or of another version."""
    return [f"{name} {version} -> {after.get(name, 'removed')}" for name, version in sorted(before.items())
            if name != own and after.get(name) != version]


def missing(manifest: Dict, present: Dict[str, str]) -> List[Dict]:
    """The manifest's packages that the environment ``present`` lacks (in any version)."""
    return [p for p in manifest["packages"] if canonical(p["name"]) not in present]


def install_commands(bundle: Path, wanted: Sequence[Dict], repo: Path, python: str) -> List[List[str]]:
    """The bundle's ``wanted`` packages, then this checkout (afresh: its version number does not
    change with its code). Only from the files named, never from an index, never their dependencies,
    never over a package already there (no ``--upgrade``)."""
    pip = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--no-build-isolation",
           "--disable-pip-version-check"]
    wheels = [pip + [str(bundle / p["file"]) for p in wanted]] if wanted else []
    return wheels + [pip + ["--force-reinstall", str(repo)]]


def install(bundle: Path, repo: Path, python: str = sys.executable, log=print) -> List[str]:
    """Install what the environment lacks of the verified bundle, then this checkout, into ``python``'s
    environment, after pip's own plan is checked against the manifest; raises :class:`BundleError`
    before installing anything it refuses, and :class:`InstallFailed` if pip fails or a package that
    was there changed. Returns ``pip list``'s difference (lines ``+ name version``)."""
    manifest = verify(bundle)
    before = snapshot(python)
    wanted = missing(manifest, before)
    for p in manifest["packages"]:
        if p not in wanted:
            log(f"kept the environment's {p['name']} {before[canonical(p['name'])]} (the bundle's: {p['version']})")
    if wanted and pip_reports(python):
        plan = pip_plan(python, ["--no-index", "--no-deps", "--no-build-isolation",
                                 *(str(bundle / p["file"]) for p in wanted)])
        check_plan(plan, {"packages": wanted}, ("wheel", "pure wheel", "built wheel"))
    for cmd in install_commands(bundle, wanted, repo, python):
        log("$ " + " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=offline_pip_environment())
        if proc.returncode != 0:
            raise InstallFailed(f"pip failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    after = snapshot(python)
    difference = [f"+ {name} {version}" for name, version in sorted(after.items()) if name not in before]
    difference += [f"~ {line}" for line in changed(before, after)]
    for line in difference:
        log(f"pip list: {line}")
    if changed(before, after):
        raise InstallFailed(f"installing changed what the environment held: {', '.join(changed(before, after))}")
    return difference


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
    pinned = {canonical(p.name): p.version for p in PINS}
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
