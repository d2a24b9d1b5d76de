"""Planning a job before it runs: the cost model, the plan and layout tools, parameter memory accounting."""
