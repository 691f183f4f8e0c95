"""setuptools entry point; what to compile with mypyc is decided in ``build_backend.py``."""

from setuptools import setup

from build_backend import compiled_extensions

setup(ext_modules=compiled_extensions())
