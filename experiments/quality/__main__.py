"""`python -m experiments.quality`: the campaign's command line (campaign.py)."""

import sys

from experiments.quality.campaign import main

sys.exit(main())
