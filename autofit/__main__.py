import sys

from autofit.cli import main

code = main()
# A rank of a torchrun job ends through the distributed module (its exit skips a finalization
# that gloo's threads can abort); a command that never imported it has no group to end.
ending = sys.modules.get("autofit.distributed")
(ending.exit_process if ending is not None else sys.exit)(code)
