"""Packaging for the engine: a trio-based LLM inference server with pluggable attention backends."""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithNative(build_py):
    """Also compile the native attention libraries (CPU always, CUDA when nvcc exists) into backends/lib."""

    def run(self) -> None:
        super().run()
        spec = importlib.util.spec_from_file_location("native_build", HERE / "native" / "build.py")
        native_build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native_build)
        editable = getattr(self, "editable_mode", False)
        out = HERE / "backends" / "lib" if editable else Path(self.build_lib) / "backends" / "lib"
        native_build.build_all(out)


BASE_REQUIREMENTS = [
    # torch is pinned: this exact release is the CPU build these machines keep on disk; an
    # unpinned torch pulls a multi-GB CUDA build.
    "torch==2.13.0",
    "triton>=3.0",  # the triton attention backend (GPU; its interpreter runs the tests on CPU)
    "transformers>=4.46",
    "tokenizers>=0.21",
    "gguf>=0.10",  # reads the default model's GGUF file
    "safetensors>=0.4",
    "trio>=0.27",
    "outcome>=1.3",  # trio's own (it resumes tasks with one); engine/frontend/output_channel.py shares a wake-up outcome
    "attrs>=23.1",
    "cattrs>=24.1",
    "orjson>=3.9",
    "cffi>=1.16",
    "numpy>=1.26",
    "quart-trio>=0.11",
    "hypercorn>=0.16",
    "prometheus_client>=0.20",
    "msgspec>=0.18",  # engine.transport.wire: msgpack frames of the attrs messages between processes (typed, no pickle)
    "tqdm>=4.66",  # LLM.generate's progress bar (use_tqdm, as in vLLM)
    "xgrammar>=0.2.6",  # structured outputs: token masks for JSON schema / regex / grammar (accepts transformers 5)
]

TEST_REQUIREMENTS = [
    "pytest>=8",
    "pytest-trio>=0.8",
    "pytest-timeout>=2.3",  # a hung test fails instead of stalling CI
    "hypothesis>=6.100",
    "accelerate>=0.30",  # transformers' GGUF model loader (the oracle) needs it
    "openai>=1.40",  # the official client, against our server
    "jsonschema>=4.20",  # responses validated against OpenAI's published schemas
    "httpx>=0.27",
    "schemathesis>=4.0",  # fuzzes the server from its own /openapi.json
    "requests>=2.31",  # the synchronous client schemathesis calls the server with
    "selenium>=4.20",  # drives Debian's headless chromium in tests/test_chat_page.py (chromedriver given: no download)
    "import-linter>=2.1",  # the layer contract (.importlinter) that .ci/run checks: a wrong import fails by name
]

setup(
    name="trio-llm-engine",
    version="0.1.0",
    description="OpenAI-compatible LLM inference server: trio actors, paged KV cache, pluggable attention backends",
    python_requires=">=3.11",  # ExceptionGroup (trio nurseries)
    packages=find_packages(include=["engine", "engine.*", "backends", "backends.*", "api", "api.*"]),
    package_data={"api": ["static/*"]},  # the chat page served at /
    install_requires=BASE_REQUIREMENTS,
    extras_require={"test": TEST_REQUIREMENTS},
    cmdclass={"build_py": BuildWithNative},
)
