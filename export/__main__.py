import sys

from addnorm.export.cli import main

sys.exit(main())
