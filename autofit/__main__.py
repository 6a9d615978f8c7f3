import sys

from autofit.cli import main

sys.exit(main())
