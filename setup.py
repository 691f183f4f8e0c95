"""setuptools entry point; what to compile with mypyc, and so what the wheel needs at run
time, is decided in ``build_backend.py``."""

from setuptools import setup

from build_backend import compiled_extensions, install_requirements

setup(ext_modules=compiled_extensions(), install_requires=install_requirements())
