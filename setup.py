"""Installs the ``megatron`` package of neox-forge (``pip install -e .``)."""

from pathlib import Path

from setuptools import find_packages, setup


def _requirements(name: str) -> list[str]:
    lines = (Path(__file__).parent / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


setup(
    name="neox-forge",
    version="0.1.0",
    description="Config-driven distributed LLM training, compatible with GPT-NeoX configs and checkpoints",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=_requirements("requirements.txt"),
    extras_require={
        "eval": _requirements("requirements-eval.txt"),
        "comet": _requirements("requirements-comet.txt"),
        "s3": _requirements("requirements-s3.txt"),
        "dev": _requirements("requirements-dev.txt"),
    },
)
