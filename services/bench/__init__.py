"""`cotserve bench ...`: load generators that print tables and ratios against a baseline run in the same process."""
