package machines

// These tests start the real `kruntimes up` (the binary built by cargo: $KRUNTIMES_BIN,
// else kruntimes in $CARGO_TARGET_DIR or the repository's target/, debug first) on
// 127.0.0.1:0 addresses in a temporary data directory, and stop its process group at the
// end. Nothing of kruntimes is faked.

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var server struct {
	kubeconfig string
	err        error
}

func kruntimesBin() (string, error) {
	if bin := os.Getenv("KRUNTIMES_BIN"); bin != "" {
		return bin, nil
	}
	target := os.Getenv("CARGO_TARGET_DIR")
	if target == "" {
		root, err := filepath.Abs("../../..")
		if err != nil {
			return "", err
		}
		target = filepath.Join(root, "target")
	}
	for _, profile := range []string{"debug", "release"} {
		candidate := filepath.Join(target, profile, "kruntimes")
		if info, err := os.Stat(candidate); err == nil && !info.IsDir() {
			return candidate, nil
		}
	}
	return "", fmt.Errorf("no kruntimes binary under %s: run `cargo build --workspace --bins` first", target)
}

func TestMain(m *testing.M) {
	os.Exit(serve(m))
}

func serve(m *testing.M) int {
	bin, err := kruntimesBin()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	dir, err := os.MkdirTemp("", "kruntimes-go-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	data := filepath.Join(dir, "data")
	cmd := exec.Command(bin, "up", "--data-dir", data, "--apiserver-addr", "127.0.0.1:0",
		"--gateway-addr", "127.0.0.1:0", "--default-min-replicas", "3")
	cmd.Env = append(os.Environ(), "RUST_LOG=warn")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}()
	ready := make(chan error, 1)
	go func() {
		scanner := bufio.NewScanner(stdout)
		var seen []string
		signalled := false
		for scanner.Scan() {
			line := scanner.Text()
			seen = append(seen, line)
			if !signalled && strings.TrimSpace(line) == "kruntimes ready" {
				signalled = true
				ready <- nil
			}
		}
		if !signalled {
			ready <- fmt.Errorf("kruntimes up ended before it was ready; it printed:\n%s", strings.Join(seen, "\n"))
		}
	}()
	select {
	case err := <-ready:
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	case <-time.After(120 * time.Second):
		fmt.Fprintln(os.Stderr, "kruntimes up was not ready within 120 s")
		return 1
	}
	server.kubeconfig = filepath.Join(data, "kubeconfig")
	return m.Run()
}

func client(t *testing.T, runtime string) *Client {
	t.Helper()
	config, err := LoadKubeconfig(server.kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(config, runtime)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestExecMachinesRunArgvWithTheShellsExitCodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	machines := client(t, "bash")
	spec := Spec{Org: "default", Class: ClassExec, Project: "go-proj", TTLSec: 600}

	// Four claims of one project at once: all Ready together, each its own machine.
	leases := make([]Lease, 4)
	errs := make([]error, 4)
	var wg sync.WaitGroup
	for i := range leases {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			leases[i], errs[i] = machines.Claim(ctx, spec)
		}(i)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("claim %d: %v", i, err)
		}
	}
	defer func() {
		for _, lease := range leases {
			if err := machines.Release(context.Background(), lease); err != nil {
				t.Errorf("release %s: %v", lease.ID, err)
			}
		}
	}()
	for i, lease := range leases {
		if lease.Status != "Ready" || lease.Org != "default" {
			t.Fatalf("lease %d: %+v", i, lease)
		}
		if err := machines.Write(ctx, lease, "in/deep/n.txt", fmt.Sprintf("machine %d", i)); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	for i, lease := range leases {
		got, err := machines.Exec(ctx, lease, ExecRequest{Argv: []string{"cat", "in/deep/n.txt"}})
		if err != nil || got.ExitCode != 0 || got.Stdout != fmt.Sprintf("machine %d", i) {
			t.Fatalf("exec %d: %+v %v", i, got, err)
		}
	}

	lease := leases[0]
	cases := []struct {
		request  ExecRequest
		code     int
		stdout   string
		stderr   string
		timedOut bool
	}{
		{ExecRequest{Argv: []string{"echo", "; rm -rf /"}}, 0, "; rm -rf /\n", "", false},
		{ExecRequest{Argv: []string{"sh", "-c", "echo $G; cat; exit 3"}, Env: map[string]string{"G": "hi"}, Stdin: "in\n"}, 3, "hi\nin\n", "", false},
		{ExecRequest{Argv: []string{"sh", "-c", "kill -9 $$"}}, 137, "", "", false},
		{ExecRequest{Argv: []string{"no-such-program"}}, 127, "", "no-such-program", false},
		{ExecRequest{Argv: []string{"sleep", "60"}, TimeoutSec: 1}, 124, "", "", true},
		{ExecRequest{Argv: []string{"pwd"}, Cwd: "in/deep"}, 0, "", "", false},
	}
	for _, c := range cases {
		got, err := machines.Exec(ctx, lease, c.request)
		if err != nil {
			t.Fatalf("%v: %v", c.request.Argv, err)
		}
		if got.ExitCode != c.code || got.TimedOut != c.timedOut ||
			(c.stdout != "" && got.Stdout != c.stdout) || !strings.Contains(got.Stderr, c.stderr) {
			t.Errorf("%v: %+v", c.request.Argv, got)
		}
		if c.request.Cwd != "" && !strings.HasSuffix(strings.TrimSpace(got.Stdout), "in/deep") {
			t.Errorf("cwd: %q", got.Stdout)
		}
	}

	// Refused before anything runs.
	if _, err := machines.Exec(ctx, lease, ExecRequest{}); err == nil {
		t.Error("an empty argv was sent")
	}
	if _, err := machines.Claim(ctx, Spec{Org: "default", Class: ClassDesktop, Project: "go-proj"}); !isStatus(err, 422) {
		t.Errorf("desktop: %v", err)
	}
	if _, err := machines.Claim(ctx, Spec{Org: "default", Class: ClassDev, Project: "Not_A_Name"}); err == nil {
		t.Error("a dev project that cannot name a Run was sent")
	}
	if _, err := machines.Claim(ctx, Spec{Org: "default", Class: ClassExec, Project: "not a label"}); err == nil {
		t.Error("a bad project was sent")
	}
}

func TestReleaseDeletesTheMachine(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	machines := client(t, "bash")
	lease, err := machines.Claim(ctx, Spec{Org: "default", Class: ClassExec, Project: "go-release"})
	if err != nil {
		t.Fatal(err)
	}
	if err := machines.Release(ctx, lease); err != nil {
		t.Fatal(err)
	}
	// Deleted: the Run goes once its worker's cleanup is done; an exec is refused meanwhile.
	if _, err := machines.Exec(ctx, lease, ExecRequest{Argv: []string{"true"}}); err == nil {
		t.Error("a released machine ran a command")
	}
	if err := machines.waitGone(ctx, "default", lease.ID, ""); err != nil {
		t.Fatal(err)
	}
}

func TestTheKubeconfigReaderReadsWhatKubectlWrites(t *testing.T) {
	doc := `apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority-data: ` + "Y2E=" + `
    server: https://127.0.0.1:6443
  name: c
contexts:
- context:
    cluster: c
    namespace: "team-a"
    user: u
  name: ctx
current-context: ctx
preferences: {}
users:
- name: u
  user:
    token: 'abc''d'
- name: gke
  user:
    exec:
      command: gke-gcloud-auth-plugin
      installHint: Install gke-gcloud-auth-plugin for use with kubectl by following
        https://cloud.google.com/kubernetes-engine/docs/how-to/cluster-access-for-kubectl#install_plugin
      provideClusterInfo: true
`
	dir := t.TempDir()
	file := filepath.Join(dir, "config")
	if err := os.WriteFile(file, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	config, err := LoadKubeconfig(file)
	if err != nil {
		t.Fatal(err)
	}
	if config.Server != "https://127.0.0.1:6443" || string(config.CAPEM) != "ca" || config.Token != "abc'd" || config.Namespace != "team-a" {
		t.Errorf("%+v", config)
	}
	doc2, err := parseYAML(doc)
	if err != nil {
		t.Fatal(err)
	}
	hint := named(doc2.(map[string]interface{})["users"], "gke", "user")["exec"].(map[string]interface{})["installHint"]
	if !strings.HasSuffix(str(hint), "by following https://cloud.google.com/kubernetes-engine/docs/how-to/cluster-access-for-kubectl#install_plugin") {
		t.Errorf("a folded scalar: %q", hint)
	}
	for _, bad := range []string{"a: &anchor x\n", "a: |\n  b\n", "a: [1, 2]\n", "\tb: c\n"} {
		if _, err := parseYAML(bad); err == nil {
			t.Errorf("%q was read", bad)
		}
	}
}

// A dev machine holds its project: a second claim gets 409 while it exists, another
// project is fine, and the files go to the next claim through the project's Workspace.
func TestDevMachinesHoldTheirProjectAndKeepItsFiles(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	machines := client(t, "bash")
	spec := Spec{Org: "default", Class: ClassDev, Project: "go-dev"}
	first, err := machines.Claim(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if first.ID != "go-dev" {
		t.Errorf("the dev machine's Run is %s", first.ID)
	}
	if err := machines.Write(ctx, first, "kept/file.txt", "kept"); err != nil {
		t.Fatal(err)
	}
	if _, err := machines.Claim(ctx, spec); !isStatus(err, 409) {
		t.Errorf("a second claim of the project: %v", err)
	}
	other, err := machines.Claim(ctx, Spec{Org: "default", Class: ClassDev, Project: "go-dev-other"})
	if err != nil {
		t.Fatal(err)
	}
	if err := machines.Release(ctx, first); err != nil {
		t.Fatal(err)
	}
	second, err := machines.Claim(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	got, err := machines.Exec(ctx, second, ExecRequest{Argv: []string{"cat", "kept/file.txt"}})
	if err != nil || got.ExitCode != 0 || got.Stdout != "kept" {
		t.Errorf("the next claim's file: %+v %v", got, err)
	}
	// The released lease names the project's Run too, but not this machine: it runs
	// nothing there and releases nothing.
	if _, err := machines.Exec(ctx, first, ExecRequest{Argv: []string{"true"}}); !isStatus(err, 404) {
		t.Errorf("exec through the released lease: %v", err)
	}
	if err := machines.Release(ctx, first); err != nil {
		t.Errorf("releasing the released lease again: %v", err)
	}
	got, err = machines.Exec(ctx, second, ExecRequest{Argv: []string{"cat", "kept/file.txt"}})
	if err != nil || got.ExitCode != 0 {
		t.Errorf("the next claim's machine after the old lease's release: %+v %v", got, err)
	}
	for _, lease := range []Lease{second, other} {
		if err := machines.Release(ctx, lease); err != nil {
			t.Error(err)
		}
	}
}
