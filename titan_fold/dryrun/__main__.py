"""`python -m titan_fold.dryrun --update-readme`: rewrite README.md's dry-run excerpt."""

import os
import sys

from titan_fold.dryrun.report import update_readme

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if sys.argv[1:] != ["--update-readme"]:
    sys.exit("usage: python -m titan_fold.dryrun --update-readme  (the dry run itself: "
             "NGPU=N python -m titan_fold.train --job.config_file FILE --comm.mode fake_backend)")
update_readme(os.path.join(ROOT, "README.md"))
