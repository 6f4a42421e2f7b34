"""`python -m experiments.size_scaling`: the campaign's command line (campaign.py)."""

import sys

from experiments.size_scaling.campaign import main

sys.exit(main())
