"""`python -m titan_fold.dryrun --update-docs`: rewrite docs/dryrun.md's dry-run excerpt."""

import os
import sys

from titan_fold.dryrun.report import update_doc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if sys.argv[1:] != ["--update-docs"]:
    sys.exit(
        "usage: python -m titan_fold.dryrun --update-docs  (the dry run itself: "
        "NGPU=N python -m titan_fold.train --job.config_file FILE --comm.mode fake_backend)"
    )
update_doc(os.path.join(ROOT, "docs", "dryrun.md"))
