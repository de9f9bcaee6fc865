"""Allow ``python -m cri_prober``."""

from cri_prober.cli import main

main()
