"""The planner: every plan the executor runs, priced and ranked (`rlloom plan`), and its
reports."""
