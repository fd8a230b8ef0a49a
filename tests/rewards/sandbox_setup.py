from rlloom.rewards.sandbox import SandboxLimits

# short budgets so that hangs end fast; memory as in production
LIMITS = SandboxLimits(cpu_s=1, wall_s=2.0)
