package machines

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"path"
	"regexp"
	"strings"
	"sync"
	"time"
)

// The labels a machine's Run carries.
const (
	ProjectLabel = "kruntimes.io/project"
	ClassLabel   = "kruntimes.io/machine-class"
)

const (
	// maxAnswerBytes bounds every answer read: an exec answer holds up to two 1 MiB
	// streams in base64.
	maxAnswerBytes = 3 << 20
	// maxOperationTimeout is the longest operation timeout a session allows.
	maxOperationTimeout = 5 * time.Minute
	// claimWait bounds a claim when the context has no deadline.
	claimWait = 5 * time.Minute
	// maxWriteBytes is the largest file one write operation carries; larger ones are
	// streamed through the file API.
	maxWriteBytes = 1 << 20
	// callTimeout bounds one API call (and a release) when the context has no deadline.
	callTimeout = time.Minute
	// watchRetry is the pause before a watch that ended at once is opened again.
	watchRetry = 100 * time.Millisecond
)

var (
	_ Machines = (*Client)(nil)

	labelValue = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$`)
	dnsLabel   = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	// A dev project names its Workspace and its Run: a DNS-1123 subdomain (a label value
	// is at most 63 characters, so one of them).
	dnsSubdomain = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$`)
)

// Error is an answer of the API server or the gateway that refused or failed a call:
// its HTTP status, its reason (`NotFound`, `SessionClosed`, `OutcomeUnknown`, …) and its
// message. A 502 `OutcomeUnknown` means the operation may or may not have run.
type Error struct {
	Status  int
	Reason  string
	Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Status, e.Reason, e.Message)
}

// Client is the machines of one kruntimes Runtime, reached with a kubeconfig's
// credentials: a machine is a session Run of that Runtime in the org's namespace, and
// every call goes through the gateway to the session's own queue. A dev machine holds its
// project's Workspace: its Run is named after the project (a second claim gets 409 while
// it exists), its files are those the project's last dev machine committed, and its
// release returns once they are committed again. desktop is refused (422): kruntimes has
// no displays. Safe for concurrent use.
type Client struct {
	config  *Kubeconfig
	runtime string
	api     *http.Client
	auth    string
	cert    *tls.Certificate

	// The gateway clients by endpoint CA bundle, so that connections are reused.
	mu       sync.Mutex
	gateways map[string]*http.Client
}

// maxGatewayClients bounds the gateway clients kept (one per distinct CA bundle).
const maxGatewayClients = 16

// New returns the machines of Runtime runtime, reached with config.
func New(config *Kubeconfig, runtime string) (*Client, error) {
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
	if len(config.CAPEM) > 0 {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(config.CAPEM) {
			return nil, fmt.Errorf("the kubeconfig's CA holds no PEM certificate")
		}
		tlsConfig.RootCAs = pool
	}
	c := &Client{config: config, runtime: runtime, gateways: map[string]*http.Client{}}
	if len(config.CertPEM) > 0 {
		cert, err := tls.X509KeyPair(config.CertPEM, config.KeyPEM)
		if err != nil {
			return nil, fmt.Errorf("the kubeconfig's client certificate: %w", err)
		}
		c.cert = &cert
		tlsConfig.Certificates = []tls.Certificate{cert}
	}
	if config.Token != "" {
		c.auth = "Bearer " + config.Token
	}
	c.api = &http.Client{Transport: transport(tlsConfig)}
	return c, nil
}

// run is the part of a Run the client reads.
type run struct {
	Metadata struct {
		Name              string            `json:"name"`
		UID               string            `json:"uid"`
		ResourceVersion   string            `json:"resourceVersion"`
		Labels            map[string]string `json:"labels"`
		DeletionTimestamp string            `json:"deletionTimestamp"`
	} `json:"metadata"`
	Spec struct {
		Workspace *struct {
			Name string `json:"name"`
		} `json:"workspace"`
	} `json:"spec"`
	Status struct {
		Phase    string `json:"phase"`
		Reason   string `json:"reason"`
		Message  string `json:"message"`
		Endpoint *struct {
			URL      string `json:"url"`
			CABundle []byte `json:"caBundle"`
		} `json:"endpoint"`
	} `json:"status"`
}

func terminal(phase string) bool {
	switch phase {
	case "Succeeded", "Failed", "Cancelled", "Timeout":
		return true
	}
	return false
}

// Claim creates a session Run of the class in namespace s.Org, labelled with its project
// and class (and with spec.timeout = s.TTLSec), and returns when it is Ready. A dev
// machine is the Run named after the project, with the project's Workspace: while it
// exists another claim of the project gets 409. An ended dev Run of the project that was
// never deleted does not block the claim: it is deleted (that Run only, by its UID) and the
// claim made again, once.
func (c *Client) Claim(ctx context.Context, s Spec) (Lease, error) {
	lease, err := c.claimOnce(ctx, s)
	if s.Class != ClassDev || !isStatus(err, http.StatusConflict) {
		return lease, err
	}
	removed, removeErr := c.removeEnded(ctx, s.Org, s.Project)
	if removeErr != nil {
		return Lease{}, removeErr
	}
	if !removed {
		return Lease{}, err
	}
	return c.claimOnce(ctx, s)
}

// removeEnded deletes the Run name of an earlier dev machine when it has ended (by its
// UID) and waits until it is gone: true when it is (or already was), false when it is
// live or still committing its Workspace (being deleted).
func (c *Client) removeEnded(ctx context.Context, org, name string) (bool, error) {
	var current run
	err := c.apiCall(ctx, http.MethodGet, runsPath(org, name), nil, &current)
	if isStatus(err, http.StatusNotFound) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	// Only a dev machine of this project: a Run of another kind that happens to carry the
	// name (a task kept for its logs) is never deleted here.
	devMachine := current.Spec.Workspace != nil && current.Spec.Workspace.Name == name &&
		current.Metadata.Labels[ClassLabel] == ClassDev
	if !devMachine || !terminal(current.Status.Phase) || current.Metadata.DeletionTimestamp != "" {
		return false, nil
	}
	deletion := map[string]interface{}{"preconditions": map[string]string{"uid": current.Metadata.UID}}
	err = c.apiCall(ctx, http.MethodDelete, runsPath(org, name), deletion, nil)
	if err != nil && !isStatus(err, http.StatusNotFound) && !isStatus(err, http.StatusConflict) {
		return false, err
	}
	if err := c.waitGone(ctx, org, name, current.Metadata.UID); err != nil {
		return false, err
	}
	return true, nil
}

func (c *Client) claimOnce(ctx context.Context, s Spec) (Lease, error) {
	class := map[string]string{ClassExec: "Exec", ClassDev: "Dev", ClassDesktop: "Desktop"}[s.Class]
	switch {
	case class == "":
		return Lease{}, fmt.Errorf("the class is one of exec, dev, desktop, not %q", s.Class)
	case !dnsLabel.MatchString(s.Org):
		return Lease{}, fmt.Errorf("the org %q is not a namespace name", s.Org)
	case !labelValue.MatchString(s.Project):
		return Lease{}, fmt.Errorf("the project %q is not 1 to 63 characters of [A-Za-z0-9._-] starting and ending alphanumeric", s.Project)
	case s.TTLSec < 0:
		return Lease{}, fmt.Errorf("TTLSec must not be negative, not %d", s.TTLSec)
	case s.Class == ClassDev && !dnsSubdomain.MatchString(s.Project):
		return Lease{}, fmt.Errorf("the project %q names a dev machine's Workspace and Run: it must be lower-case [a-z0-9.-], starting and ending alphanumeric", s.Project)
	}
	spec := map[string]interface{}{
		"runtime": c.runtime,
		"mode":    map[string]interface{}{"session": map[string]interface{}{"class": class}},
	}
	if s.TTLSec > 0 {
		spec["timeout"] = fmt.Sprintf("%ds", s.TTLSec)
	}
	metadata := map[string]interface{}{
		"generateName": namePrefix(s.Project) + "-",
		"labels":       map[string]string{ProjectLabel: s.Project, ClassLabel: s.Class},
		// runtimed would add it before registering the session; added here, it saves
		// the claim one write (as the other SDKs do).
		"finalizers": []string{"kruntimes.io/registration-cleanup"},
	}
	if s.Class == ClassDev {
		// The Run's name is the project's lock.
		delete(metadata, "generateName")
		metadata["name"] = s.Project
		spec["workspace"] = map[string]string{"name": s.Project}
	}
	body := map[string]interface{}{
		"apiVersion": "kruntimes.io/v1alpha1",
		"kind":       "Run",
		"metadata":   metadata,
		"spec":       spec,
	}
	var created run
	if err := c.apiCall(ctx, http.MethodPost, runsPath(s.Org, ""), body, &created); err != nil {
		return Lease{}, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, claimWait)
		defer cancel()
	}
	ready, err := c.waitReady(ctx, s.Org, &created)
	if err != nil {
		// Not left holding a slot: best effort, on a context of its own (the claim's may
		// be what ran out); the claim's error is what the caller hears.
		cleanup, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		_ = c.endAndDelete(cleanup, s.Org, created.Metadata.Name, created.Metadata.UID)
		return Lease{}, err
	}
	return Lease{ID: ready.Metadata.Name, Org: s.Org, Status: ready.Status.Phase, uid: ready.Metadata.UID}, nil
}

// waitReady watches the Run until it is Ready with an endpoint, or ends.
func (c *Client) waitReady(ctx context.Context, org string, r *run) (*run, error) {
	name := r.Metadata.Name
	version := r.Metadata.ResourceVersion
	for {
		if r.Status.Phase == "Ready" && r.Status.Endpoint != nil {
			return r, nil
		}
		if terminal(r.Status.Phase) {
			return nil, fmt.Errorf("machine %s/%s ended %s before it was Ready: %s: %s", org, name, r.Status.Phase, r.Status.Reason, r.Status.Message)
		}
		query := url.Values{
			"watch":           {"true"},
			"fieldSelector":   {"metadata.name=" + name},
			"resourceVersion": {version},
		}
		next, err := c.watchNext(ctx, runsPath(org, "")+"?"+query.Encode(), name)
		if err != nil {
			return nil, err
		}
		if next == nil {
			// The watch ended (or its history was compacted): read the Run afresh, after
			// a pause, so that a watch that keeps ending at once is not a busy loop.
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("machine %s was not Ready in time: %w", name, ctx.Err())
			case <-time.After(watchRetry):
			}
			fresh := &run{}
			if err := c.apiCall(ctx, http.MethodGet, runsPath(org, name), nil, fresh); err != nil {
				return nil, err
			}
			next = fresh
		}
		r = next
		version = r.Metadata.ResourceVersion
	}
}

// watchNext reads one watch until the Run changes to Ready or an end (that Run), or the
// watch ends (nil).
func (c *Client) watchNext(ctx context.Context, target, name string) (*run, error) {
	return c.watchUntil(ctx, target, name, func(kind string, object *run) (bool, error) {
		switch {
		case kind == "DELETED":
			return false, fmt.Errorf("machine %s was deleted before it was Ready", name)
		case object.Metadata.Name != name:
			return false, nil
		}
		return (object.Status.Phase == "Ready" && object.Status.Endpoint != nil) || terminal(object.Status.Phase), nil
	}, "machine %s was not Ready in time: %w")
}

// watchUntil reads one watch of target until done says an event of Run name is the one
// waited for (returned), or errs, or the watch ends (nil, nil); an ERROR event ends it.
// A context that ran out is an error worded by timeoutFormat (the name, the cause).
func (c *Client) watchUntil(ctx context.Context, target, name string, done func(kind string, object *run) (bool, error), timeoutFormat string) (*run, error) {
	req, err := c.request(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.api.Do(req)
	if err != nil {
		return nil, fmt.Errorf("watch machine %s: %w", name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusGone {
		return nil, nil
	}
	if resp.StatusCode != http.StatusOK {
		return nil, answerError(resp)
	}
	decoder := json.NewDecoder(resp.Body)
	for {
		var event struct {
			Type   string `json:"type"`
			Object run    `json:"object"`
		}
		if err := decoder.Decode(&event); err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf(timeoutFormat, name, ctx.Err())
			}
			return nil, nil
		}
		if event.Type == "ERROR" {
			return nil, nil
		}
		object := event.Object
		matched, err := done(event.Type, &object)
		if err != nil {
			return nil, err
		}
		if matched {
			return &object, nil
		}
	}
}

// Write puts content at path on the machine (directories made as needed) after every
// operation sent to the machine before it; a file over 1 MiB is streamed through the file
// API instead, which is not queued.
func (c *Client) Write(ctx context.Context, l Lease, file, content string) error {
	target, err := c.machine(ctx, l)
	if err != nil {
		return err
	}
	if dir := path.Dir(file); dir != "." && dir != "/" && dir != "" {
		made, err := c.execute(ctx, target, map[string]interface{}{"makeDirectory": map[string]interface{}{"path": dir, "parents": true}}, 0)
		if err != nil {
			return err
		}
		if made.State != "Succeeded" {
			return fmt.Errorf("write %s: make %s: %s: %s", file, dir, made.Reason, made.Message)
		}
	}
	if len(content) > maxWriteBytes {
		return c.upload(ctx, target, file, content)
	}
	operation := map[string]interface{}{"writeFile": map[string]interface{}{
		"path":    file,
		"content": base64.StdEncoding.EncodeToString([]byte(content)),
	}}
	done, err := c.execute(ctx, target, operation, 0)
	if err != nil {
		return err
	}
	if done.State != "Succeeded" {
		return fmt.Errorf("write %s: %s: %s", file, done.Reason, done.Message)
	}
	return nil
}

// Exec runs r.Argv on the machine (never through a shell), after every operation sent to
// it before. A non-zero ExitCode is a result: 128 + a killing signal, 124 with TimedOut
// when its timeout ran out, 127 when the program does not exist (126: not executable).
// A broken machine, a lost worker or an ended session is an error (an *Error for the
// gateway's answers), never an exit code.
func (c *Client) Exec(ctx context.Context, l Lease, r ExecRequest) (ExecResult, error) {
	if len(r.Argv) == 0 {
		return ExecResult{}, fmt.Errorf("argv is empty")
	}
	if r.TimeoutSec < 0 {
		return ExecResult{}, fmt.Errorf("TimeoutSec must not be negative, not %d", r.TimeoutSec)
	}
	target, err := c.machine(ctx, l)
	if err != nil {
		return ExecResult{}, err
	}
	command := map[string]interface{}{"argv": r.Argv}
	if r.Cwd != "" {
		command["cwd"] = r.Cwd
	}
	if len(r.Env) > 0 {
		command["env"] = r.Env
	}
	if r.Stdin != "" {
		command["stdin"] = base64.StdEncoding.EncodeToString([]byte(r.Stdin))
	}
	timeout := time.Duration(r.TimeoutSec) * time.Second
	done, err := c.execute(ctx, target, map[string]interface{}{"command": command}, timeout)
	if err != nil {
		return ExecResult{}, err
	}
	if done.ExitCode == nil {
		return ExecResult{}, fmt.Errorf("the command's result has no exit code (%s: %s)", done.Reason, done.Message)
	}
	stdout, errOut := base64.StdEncoding.DecodeString(done.Stdout)
	stderr, errErr := base64.StdEncoding.DecodeString(done.Stderr)
	if errOut != nil || errErr != nil {
		return ExecResult{}, fmt.Errorf("the gateway's output is not base64")
	}
	return ExecResult{
		ExitCode:   *done.ExitCode,
		Stdout:     string(stdout),
		Stderr:     string(stderr),
		DurationMs: int64(done.DurationMs),
		TimedOut:   done.TimedOut,
	}, nil
}

// Release gives the machine back: the Run is asked to end at once (anything still running
// is cancelled) and deleted; its worker cleans up.
func (c *Client) Release(ctx context.Context, l Lease) error {
	if !dnsLabel.MatchString(l.Org) {
		return fmt.Errorf("the lease's org %q is not a namespace name", l.Org)
	}
	ctx, cancel := withDefaultTimeout(ctx, callTimeout)
	defer cancel()
	var current run
	err := c.apiCall(ctx, http.MethodGet, runsPath(l.Org, l.ID), nil, &current)
	if isStatus(err, http.StatusNotFound) {
		return nil // released already
	}
	if err != nil {
		return err
	}
	if l.uid != "" && current.Metadata.UID != l.uid {
		return nil // released already: the Run of that name is a later machine
	}
	if _, ok := current.Metadata.Labels[ClassLabel]; !ok {
		return fmt.Errorf("%s/%s is not a machine", l.Org, l.ID)
	}
	if err := c.endAndDelete(ctx, l.Org, l.ID, current.Metadata.UID); err != nil {
		return err
	}
	if current.Spec.Workspace == nil {
		return nil
	}
	// A dev machine is released once its files are committed: the worker commits before
	// it lets the Run go, so the next claim of the project finds them.
	return c.waitGone(ctx, l.Org, l.ID, current.Metadata.UID)
}

// waitGone watches Run name until the object of UID uid (any, when empty) is deleted (or
// is gone already).
func (c *Client) waitGone(ctx context.Context, org, name, uid string) error {
	for {
		var current run
		err := c.apiCall(ctx, http.MethodGet, runsPath(org, name), nil, &current)
		if isStatus(err, http.StatusNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		if uid != "" && current.Metadata.UID != uid {
			return nil
		}
		query := url.Values{
			"watch":           {"true"},
			"fieldSelector":   {"metadata.name=" + name},
			"resourceVersion": {current.Metadata.ResourceVersion},
		}
		deleted, err := c.watchUntil(ctx, runsPath(org, "")+"?"+query.Encode(), name, func(kind string, object *run) (bool, error) {
			return kind == "DELETED" && (uid == "" || object.Metadata.UID == uid), nil
		}, "machine %s was not released in time: %w")
		if deleted != nil || err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("machine %s/%s was not released in time: %w", org, name, ctx.Err())
		case <-time.After(watchRetry):
		}
	}
}

// endAndDelete asks Run name to end at once and deletes it (only while its UID is uid),
// without waiting. A Run gone, ended (422 on the termination) or replaced (409 on the
// delete) is fine.
func (c *Client) endAndDelete(ctx context.Context, org, name, uid string) error {
	patch := map[string]interface{}{"spec": map[string]interface{}{"termination": map[string]interface{}{"mode": "Immediate"}}}
	err := c.apiCall(ctx, http.MethodPatch, runsPath(org, name), patch, nil)
	if err != nil && !isStatus(err, http.StatusNotFound) && !isStatus(err, http.StatusUnprocessableEntity) {
		return err
	}
	deletion := map[string]interface{}{"preconditions": map[string]string{"uid": uid}}
	err = c.apiCall(ctx, http.MethodDelete, runsPath(org, name), deletion, nil)
	if err != nil && !isStatus(err, http.StatusNotFound) && !isStatus(err, http.StatusConflict) {
		return err
	}
	return nil
}

// machine reads the lease's Run and checks that it is a Ready machine with an endpoint.
func (c *Client) machine(ctx context.Context, l Lease) (*run, error) {
	if !dnsLabel.MatchString(l.Org) {
		return nil, fmt.Errorf("the lease's org %q is not a namespace name", l.Org)
	}
	var current run
	if err := c.apiCall(ctx, http.MethodGet, runsPath(l.Org, l.ID), nil, &current); err != nil {
		return nil, err
	}
	if l.uid != "" && current.Metadata.UID != l.uid {
		return nil, &Error{Status: http.StatusNotFound, Reason: "NotFound", Message: fmt.Sprintf("machine %s/%s was released: the Run of that name is a later machine", l.Org, l.ID)}
	}
	if _, ok := current.Metadata.Labels[ClassLabel]; !ok {
		return nil, fmt.Errorf("%s/%s is not a machine", l.Org, l.ID)
	}
	if current.Status.Phase != "Ready" || current.Status.Endpoint == nil {
		return nil, &Error{Status: http.StatusConflict, Reason: "NotReady", Message: fmt.Sprintf("machine %s/%s is %s", l.Org, l.ID, current.Status.Phase)}
	}
	endpoint, err := url.Parse(current.Status.Endpoint.URL)
	if err != nil || endpoint.Scheme != "https" || endpoint.Host == "" {
		// The token goes with every call: never in clear, never to a URL without a host.
		return nil, fmt.Errorf("the endpoint of machine %s/%s is not an https URL", l.Org, l.ID)
	}
	if !strings.HasSuffix(endpoint.Path, "/sessions/"+current.Metadata.UID) {
		return nil, fmt.Errorf("the endpoint of machine %s/%s does not name it", l.Org, l.ID)
	}
	return &current, nil
}

// executed is the gateway's answer to `operations:execute`.
type executed struct {
	State      string  `json:"state"`
	Reason     string  `json:"reason"`
	Message    string  `json:"message"`
	ExitCode   *int    `json:"exitCode"`
	TimedOut   bool    `json:"timedOut"`
	DurationMs float64 `json:"durationMs"`
	Stdout     string  `json:"stdout"`
	Stderr     string  `json:"stderr"`
}

// execute runs one operation on the machine with `POST …/operations:execute`.
func (c *Client) execute(ctx context.Context, target *run, operation map[string]interface{}, timeout time.Duration) (*executed, error) {
	if timeout > 0 {
		operation["timeoutSeconds"] = timeout.Seconds()
	}
	body, err := json.Marshal(operation)
	if err != nil {
		return nil, err
	}
	client, err := c.gateway(target)
	if err != nil {
		return nil, err
	}
	wait := maxOperationTimeout + time.Minute
	if timeout > 0 {
		wait += timeout
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target.Status.Endpoint.URL+"/operations:execute", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	c.authorize(req)
	resp, err := client.Do(req)
	if err != nil {
		return nil, sendError(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, answerError(resp)
	}
	var done executed
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxAnswerBytes)).Decode(&done); err != nil {
		return nil, fmt.Errorf("the gateway's answer is malformed: %w", err)
	}
	return &done, nil
}

// upload streams a large file with `PUT …/files?path=`.
func (c *Client) upload(ctx context.Context, target *run, file, content string) error {
	client, err := c.gateway(target)
	if err != nil {
		return err
	}
	ctx, cancel := withDefaultTimeout(ctx, 30*time.Minute)
	defer cancel()
	address := target.Status.Endpoint.URL + "/files?path=" + url.QueryEscape(file)
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, address, strings.NewReader(content))
	if err != nil {
		return err
	}
	req.ContentLength = int64(len(content))
	c.authorize(req)
	resp, err := client.Do(req)
	if err != nil {
		return sendError(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return answerError(resp)
	}
	return nil
}

// gateway returns a client that trusts the Run's endpoint CA only (kept per CA bundle).
func (c *Client) gateway(target *run) (*http.Client, error) {
	key := string(target.Status.Endpoint.CABundle)
	c.mu.Lock()
	defer c.mu.Unlock()
	if client, ok := c.gateways[key]; ok {
		return client, nil
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(target.Status.Endpoint.CABundle) {
		return nil, fmt.Errorf("the machine's endpoint has no CA bundle")
	}
	tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool}
	if c.cert != nil {
		tlsConfig.Certificates = []tls.Certificate{*c.cert}
	}
	client := &http.Client{Transport: transport(tlsConfig)}
	if len(c.gateways) >= maxGatewayClients {
		for old, kept := range c.gateways {
			kept.CloseIdleConnections()
			delete(c.gateways, old)
		}
	}
	c.gateways[key] = client
	return client, nil
}

// sendError is the error of a gateway call that got no answer: when the connection or its
// TLS handshake failed, nothing was sent (a plain error); otherwise the request may have
// been acted on, and its outcome is unknown (502 OutcomeUnknown).
func sendError(err error) error {
	var opErr *net.OpError
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	if (errors.As(err, &opErr) && opErr.Op == "dial") || errors.As(err, &unknownCA) ||
		errors.As(err, &hostname) || errors.As(err, &invalid) {
		return fmt.Errorf("the gateway was not reached; nothing was sent: %w", err)
	}
	return &Error{Status: http.StatusBadGateway, Reason: "OutcomeUnknown", Message: fmt.Sprintf("the request was sent and its answer lost: %v", err)}
}

// transport bounds connecting and the TLS handshake; how long an answer may take is the
// caller's context's (and each call's own default).
func transport(config *tls.Config) *http.Transport {
	return &http.Transport{
		TLSClientConfig:     config,
		ForceAttemptHTTP2:   true,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 10 * time.Second,
		IdleConnTimeout:     90 * time.Second,
	}
}

// withDefaultTimeout gives ctx a deadline of limit when it has none.
func withDefaultTimeout(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, limit)
}

func (c *Client) authorize(req *http.Request) {
	if c.auth != "" {
		req.Header.Set("Authorization", c.auth)
	}
}

func (c *Client) request(ctx context.Context, method, target string, body interface{}) (*http.Request, error) {
	var reader io.Reader
	if body != nil {
		data, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		reader = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(c.config.Server, "/")+target, reader)
	if err != nil {
		return nil, err
	}
	if body != nil {
		contentType := "application/json"
		if method == http.MethodPatch {
			contentType = "application/merge-patch+json"
		}
		req.Header.Set("Content-Type", contentType)
	}
	req.Header.Set("Accept", "application/json")
	c.authorize(req)
	return req, nil
}

// apiCall sends one request to the API server and decodes its JSON answer into out
// (within callTimeout when ctx has no deadline).
func (c *Client) apiCall(ctx context.Context, method, target string, body, out interface{}) error {
	ctx, cancel := withDefaultTimeout(ctx, callTimeout)
	defer cancel()
	req, err := c.request(ctx, method, target, body)
	if err != nil {
		return err
	}
	resp, err := c.api.Do(req)
	if err != nil {
		return fmt.Errorf("%s %s: %w", method, target, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return answerError(resp)
	}
	if out == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxAnswerBytes))
		return nil
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxAnswerBytes)).Decode(out); err != nil {
		return fmt.Errorf("%s %s: a malformed answer: %w", method, target, err)
	}
	return nil
}

// answerError reads an error answer (a Kubernetes Status or the gateway's error body).
func answerError(resp *http.Response) error {
	var status struct {
		Reason  string `json:"reason"`
		Message string `json:"message"`
	}
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	_ = json.Unmarshal(data, &status)
	if status.Message == "" {
		status.Message = strings.TrimSpace(string(data))
	}
	if len(status.Message) > 1024 {
		status.Message = status.Message[:1024]
	}
	return &Error{Status: resp.StatusCode, Reason: status.Reason, Message: status.Message}
}

func isStatus(err error, status int) bool {
	e, ok := err.(*Error)
	return ok && e.Status == status
}

func runsPath(namespace, name string) string {
	p := "/apis/kruntimes.io/v1alpha1/namespaces/" + url.PathEscape(namespace) + "/runs"
	if name != "" {
		p += "/" + url.PathEscape(name)
	}
	return p
}

// namePrefix makes a DNS-label prefix of at most 40 characters from a project.
func namePrefix(project string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(project) {
		if b.Len() == 40 {
			break
		}
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else {
			b.WriteByte('-')
		}
	}
	prefix := strings.TrimRight(b.String(), "-")
	if prefix == "" || prefix[0] < 'a' || prefix[0] > 'z' {
		prefix = "m-" + prefix
	}
	return prefix
}
