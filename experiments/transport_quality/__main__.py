"""`python -m experiments.transport_quality`: the campaign's command line (campaign.py)."""

from experiments.transport_quality.campaign import main

main()
