from setuptools import find_packages, setup

setup(
    name="kerple-fairseq",
    version="0.1.0",
    description="fairseq plugin: pluggable positional attention-bias kernels (ALiBi, KERPLE, ...) "
    "for length-extrapolation research",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kerple_core", "kerple_core.*", "kerple_fairseq", "kerple_fairseq.*"]),
    python_requires=">=3.10,<3.14",  # tried: 3.10 to 3.13 (torch 2.13.0 starts at 3.10)
    install_requires=[
        # fairseq 0.12.2's own rebuild: 0.12.2 does not run on Python 3.11+, and pip 24.1 and later refuse
        # the metadata of the omegaconf and hydra-core releases it pins (so it no longer installs on 3.10)
        "fairseq-fixed==0.12.3.1",
        "torch",
        "sacremoses",
        # NumPy 1 or 2, whichever the environment holds: fairseq 0.12's np.compat, which NumPy 2
        # removed, is supplied by kerple_fairseq/fairseq_changes.py
        "numpy",
        "tensorboard",
    ],
    extras_require={"test": ["pytest", "pytest-xdist", "pytest-timeout", "filelock"], "plots": ["matplotlib"]},
    entry_points={"console_scripts": [
        "kerple-eval-lm = kerple_fairseq.evaluation.cli:cli_main",
        "kerple-analyze = kerple_fairseq.analysis.cli:cli_main",
    ]},
)
