"""`python -m ditron_ep` — see `ditron_ep.cli`."""
import sys

from ditron_ep.cli import main

sys.exit(main())
