import sys

from bench.sits.run import main

sys.exit(main())
