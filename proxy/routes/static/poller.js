// Runs an async function again and again, never two at once, at a steady pace while it succeeds,
// backing off while it fails, and not at all while the tab is hidden.

export class Poller {
  constructor(fn, { intervalMs = 3000, maxIntervalMs = 30000 } = {}) {
    this.fn = fn; // async () => boolean: true when the round went well
    this.intervalMs = intervalMs;
    this.maxIntervalMs = maxIntervalMs;
    this.failures = 0;
    this.running = false;
    this.again = false;
    this.timer = null;
    this.rounds = 0;
  }

  start() {
    document.addEventListener("visibilitychange", () => {
      if (document.hidden) {
        clearTimeout(this.timer);
        this.timer = null;
        if (!this.running) document.body.dataset.polling = "paused"; // else: when the round ends
      } else {
        this.now();
      }
    });
    this.now();
  }

  // Poll as soon as possible: at once if idle, right after the current round otherwise.
  now() {
    if (this.running) {
      this.again = true;
      return;
    }
    clearTimeout(this.timer);
    this.timer = null;
    if (!document.hidden) this.run();
  }

  async run() {
    this.running = true;
    document.body.dataset.polling = "running";
    let ok = false;
    try {
      ok = await this.fn();
    } catch {
      ok = false;
    } finally {
      this.running = false;
    }
    this.rounds += 1;
    document.body.dataset.pollRounds = String(this.rounds);
    this.failures = ok ? 0 : this.failures + 1;
    // Visible state for people debugging the page (and for its browser test): no timing to guess.
    document.body.dataset.pollDelayMs = String(this.delayMs());
    const again = this.again;
    this.again = false;
    if (document.hidden) {
      document.body.dataset.polling = "paused";
      return;
    }
    if (again) {
      this.run();
      return;
    }
    document.body.dataset.polling = "waiting";
    this.timer = setTimeout(() => {
      this.timer = null;
      this.now();
    }, this.delayMs());
  }

  delayMs() {
    return Math.min(this.maxIntervalMs, this.intervalMs * 2 ** Math.min(this.failures, 8));
  }
}
