import sys

from addnorm.service.cli import main

sys.exit(main())
