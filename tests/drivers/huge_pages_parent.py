"""Prepares its children's environment as the plugin does in SGLang's launcher, then runs the script
given as its argument in a new interpreter, as SGLang starts its scheduler processes
(tests/unit/test_huge_pages.py)."""

import subprocess
import sys

from histospec_sgl import hugepages

print(hugepages.prepare_children(), file=sys.stderr)
sys.exit(subprocess.call([sys.executable, *sys.argv[1:]]))
