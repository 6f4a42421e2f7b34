"""`python -m experiments.honest`: the campaign's command line (campaign.py)."""

import sys

from experiments.honest.campaign import main

sys.exit(main())
