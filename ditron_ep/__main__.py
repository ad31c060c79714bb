"""`python -m ditron_ep` — see `ditron_ep.cli`."""
import sys

from .cli import main

sys.exit(main())
