"""Write a small random Hugging Face checkpoint of any k3text model config.

    python tools/convert/make_tiny_checkpoint.py --model-config YML --out DIR
        [--layout k3|moonshot|transformers] [--seed N] [--shards N] [--force]

The logic is `k3text.checkpoint.synthetic`.
"""

import sys

from k3text.checkpoint.synthetic import main

if __name__ == "__main__":
    sys.exit(main())
