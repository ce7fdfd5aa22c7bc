"""Convert a Hugging Face safetensors checkpoint into a k3text checkpoint.

    python tools/convert/hf_to_k3text.py --hf-dir DIR --out DIR [--model-config YML]
        [--dry-run] [--force]

Also installed as `k3text-convert`; the logic is `k3text.checkpoint.convert`.
"""

import sys

from k3text.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
