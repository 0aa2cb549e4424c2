/* The sandbox ("pause") container of the local test node: holds the pod's
 * namespaces, reaps orphans, and exits on SIGTERM/SIGINT. Built static with
 * gcc by scripts/image.sh; the node has no registry to pull one from. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig)
{
	(void)sig;
	_exit(0);
}

static void on_child(int sig)
{
	(void)sig;
	while (waitpid(-1, NULL, WNOHANG) > 0) {
	}
}

int main(void)
{
	signal(SIGTERM, on_stop);
	signal(SIGINT, on_stop);
	signal(SIGCHLD, on_child);
	for (;;)
		pause();
	return 0;
}
